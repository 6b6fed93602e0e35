"""Waiting until a server answers: the one readiness loop of every tool that starts servers.

    wait_ready("http://127.0.0.1:8000/health", timeout_s=120, exited=proc.poll)

Polls `GET url` until it answers 200; raises `KvtierError` when `timeout_s` passes or when
`exited()` returns an exit code first (the server died while starting). Blocking: async
callers run it in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

from kvtier.core.errors import KvtierError

__all__ = ["wait_ready"]


def wait_ready(
    url: str,
    timeout_s: float,
    *,
    exited: Callable[[], int | None] | None = None,
    what: str | None = None,
    interval_s: float = 0.3,
) -> None:
    """Return once `url` answers 200 (see the module docstring)."""
    what = what or url
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = exited() if exited is not None else None
        if code is not None:
            raise KvtierError(f"{what}: exited with code {code} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval_s)
    raise KvtierError(f"{what}: not ready after {timeout_s:.0f} s")
