"""The monitoring-cost tool finds a target's process by its listening port."""

from __future__ import annotations

import os
import socket

import pytest

from kvtier.tools.bench.monitoring_cost import cpu_seconds, listener


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
