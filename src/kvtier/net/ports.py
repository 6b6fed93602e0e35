"""Free loopback ports for the servers kvtier starts (replicas, router, Valkey, metrics).

Everything kvtier starts listens on 127.0.0.1 only.

Ports come from below the kernel's ephemeral range (`ip_local_port_range`): a port picked there
cannot be taken, between the pick and the server's bind, by a socket bound to port 0 or by an
outgoing connection, which is what a vLLM engine starting beside it opens by the dozen. Within
one process a port is handed out once.
"""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack
from pathlib import Path

from kvtier.core.errors import KvtierError

_LOWEST = 10000
"""Below this, ports are left to well-known and registered services."""
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody listens on now, outside the ephemeral range, not handed out
    before by this process."""
    return free_port_range(1)


def free_port_range(count: int, attempts: int = 200, step: int = 1) -> int:
    """First of `count` such ports, `step` apart (1: consecutive)."""
    low, high = _pick_range()
    span = step * (count - 1) + 1
    if high - low < span:
        raise KvtierError(
            f"no room for {count} ports {step} apart outside the ephemeral range "
            f"({_EPHEMERAL_RANGE})"
        )
    for _ in range(attempts):
        base = random.randrange(low, high - span + 1)
        ports = range(base, base + span, step)
        if _handed_out.intersection(ports) or not _all_free(ports):
            continue
        _handed_out.update(ports)
        return base
    raise KvtierError(f"no {count} free ports {step} apart found in {low}-{high}")


def _pick_range() -> tuple[int, int]:
    """The widest span of ports outside the ephemeral range, as [low, high)."""
    try:
        first, last = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        first, last = 32768, 60999
    below, above = (_LOWEST, first), (last + 1, 65536)
    return max(below, above, key=lambda span: span[1] - span[0])


def _all_free(ports: range) -> bool:
    try:
        with ExitStack() as held:
            for port in ports:
                s = held.enter_context(socket.socket())
                s.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
