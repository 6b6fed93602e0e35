"""The monitoring-cost tool finds a target's process by its listening port and sums up its
rounds."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvtier.tools.bench.monitoring_cost import cpu_seconds, listener, main, quartiles


def test_the_process_listening_on_a_url_is_found_and_its_cpu_read() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = listener(f"http://127.0.0.1:{port}")
        assert proc.pid == os.getpid()
        assert cpu_seconds(proc) > 0
    with pytest.raises(SystemExit, match="no process listens"):
        listener(f"http://127.0.0.1:{port}")


def test_one_round_has_a_median_and_no_quartiles() -> None:
    assert quartiles([1.25]) == "median 1.250, no quartiles of one round"
    assert quartiles([1.0, 2.0, 3.0]) == "median 2.000, quartiles 1.000-3.000"


def test_negative_rounds_are_refused_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(tmp_path / "cluster.json")  # never read: the arguments are checked first
    monkeypatch.setattr("sys.argv", ["monitoring_cost", "--state", state, "--rounds", "-1"])
    with pytest.raises(SystemExit):
        main()
    assert "--rounds: must be 0 or more" in capsys.readouterr().err
