"""Waiting until a server answers: the one readiness loop of every tool that starts servers.

    wait_ready("http://127.0.0.1:8000/health", timeout_s=120, exited=proc.poll)

Polls `GET url` until it answers 200; raises `KvtierError` when `timeout_s` passes or when
`exited()` returns an exit code first (the server died while starting). A 200 counts only if
`exited()` still returns None after it: a server that died has not answered it, whoever else
listens on its port did. Blocking: async callers run it in a thread (`asyncio.to_thread`).
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
        _check_alive(exited, what)
        if _answers_200(url):
            _check_alive(exited, what)
            return
        time.sleep(interval_s)
    raise KvtierError(f"{what}: not ready after {timeout_s:.0f} s")


def _check_alive(exited: Callable[[], int | None] | None, what: str) -> None:
    """Raise `KvtierError` if `exited()` returns an exit code."""
    code = exited() if exited is not None else None
    if code is not None:
        raise KvtierError(f"{what}: exited with code {code} while starting")


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
