"""Ports handed to the servers kvtier starts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtier.net.ports import free_port, free_port_range


def _ephemeral() -> range:
    first, last = (
        int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    )
    return range(first, last + 1)


def test_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    ephemeral = _ephemeral()
    for _ in range(50):
        port = free_port()
        assert port not in ephemeral
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_no_port_is_handed_out_twice_in_one_process() -> None:
    seen: list[int] = []
    for _ in range(300):
        base = free_port_range(3)
        seen.extend(range(base, base + 3))
    assert len(seen) == len(set(seen))


def test_ports_step_apart_are_all_free_and_never_handed_out_again() -> None:
    seen: list[int] = []
    for _ in range(50):
        base = free_port_range(2, step=10000)  # a Valkey cluster node and its bus
        for port in (base, base + 10000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        seen += [base, base + 10000]
    assert len(seen) == len(set(seen))


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken, taken + 10])
        monkeypatch.setattr("kvtier.net.ports.random.randrange", lambda *_: next(picks))
        assert free_port() == taken + 10
