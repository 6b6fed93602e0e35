"""The Prometheus process a fleet starts: reported as soon as it exists, stopped on a failed
start (`kvtier.tools.monitoring.Prometheus`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tools import monitoring
from kvtier.tools.monitoring import Prometheus
from tests.helpers.procs import running


def test_its_pid_is_reported_before_the_readiness_wait_and_an_interrupted_start_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvtier up` records the pid it gets in its state file, so that `kvtier down` stops a
    Prometheus still starting when `kvtier up` was killed."""
    reported: list[int] = []

    def interrupted(*_args: object, **_kwargs: object) -> None:
        assert reported and running(reported[0])  # reported, and already running
        raise KeyboardInterrupt  # a Ctrl-C while start() waits for /-/ready

    monkeypatch.setattr(monitoring, "wait_ready", interrupted)
    prometheus = Prometheus(
        tmp_path, "http://127.0.0.1:9", ["http://127.0.0.1:9"], on_started=reported.append
    )
    with pytest.raises(KeyboardInterrupt):
        prometheus.start()
    assert len(reported) == 1 and not running(reported[0])
    assert prometheus.pid is None
