"""`Deadline`: a connection's one timeout, moved without touching the event loop's timers.

A connection arms and disarms its timeout several times per request (a head to arrive, an
answer to come, an idle keep-alive). `arm` and `disarm` only move the deadline; the loop's
timer is replaced only when the new deadline is sooner than the timer, and a timer that fires
before the deadline schedules itself again for the rest. On a busy connection the timer thus
fires about once per timeout span instead of being created and cancelled per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Deadline"]


class Deadline:
    """Calls `expire` once `delay_s` after the last `arm`, unless disarmed first."""

    __slots__ = ("_at", "_expire", "_fires_at", "_handle", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._at = 0.0
        self._expire: Callable[[], None] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._fires_at = 0.0

    @property
    def armed(self) -> bool:
        return self._expire is not None

    @property
    def expire(self) -> Callable[[], None] | None:
        """What is armed, if anything."""
        return self._expire

    def arm(self, delay_s: float, expire: Callable[[], None]) -> None:
        """Call `expire` in `delay_s` seconds (replacing what was armed)."""
        self._at = self._loop.time() + delay_s
        self._expire = expire
        if self._handle is None or self._fires_at > self._at:
            self._schedule()

    def disarm(self) -> None:
        self._expire = None

    def close(self) -> None:
        """Disarm and drop the loop's timer (the connection is gone)."""
        self._expire = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._fires_at = self._at
        self._handle = self._loop.call_at(self._at, self._fire)

    def _fire(self) -> None:
        self._handle = None
        expire = self._expire
        if expire is None:
            return
        if self._loop.time() < self._at:  # armed again since the timer was set
            self._schedule()
            return
        self._expire = None
        expire()
