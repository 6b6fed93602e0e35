"""Free loopback ports for the servers kvtier starts (replicas, router, Valkey, metrics).

Everything kvtier starts listens on 127.0.0.1 only.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack

from kvtier.core.errors import KvtierError


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(count: int, attempts: int = 50) -> int:
    """First of `count` consecutive loopback ports that are free now."""
    for _ in range(attempts):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            with ExitStack() as held:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise KvtierError(f"no {count} consecutive free ports found")
