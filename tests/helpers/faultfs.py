"""A Ctrl-C while a faultfs mount waits for its daemon, for the failure-path tests."""

from __future__ import annotations

import pytest

from kvtier.tools.chaos.faultfs import FaultFS


def interrupt_the_first_mount_wait(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the first `FaultFS.mounted` check raise KeyboardInterrupt (a Ctrl-C while `mount`
    waits for its daemon); returns the list that then holds that daemon's pid."""
    daemons: list[int] = []
    real = FaultFS.mounted

    def interrupted_once(self: FaultFS) -> bool:
        if not daemons:
            assert self.process is not None
            daemons.append(self.process.pid)
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(FaultFS, "mounted", interrupted_once)
    return daemons
