"""Fixtures shared by the `kvtier up` / `kvtier down` tests."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.fixture
def no_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test that sends any signal (rather than let it hit init or the test's group)."""

    def refuse(*args: object) -> None:
        raise AssertionError(f"signalled {args}")

    for owner, name in ((os, "kill"), (os, "killpg"), (signal, "pidfd_send_signal")):
        monkeypatch.setattr(owner, name, refuse)
