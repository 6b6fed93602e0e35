"""Deadlines on the monotonic clock, for calls that share one timeout across several waits."""

from __future__ import annotations

import time

__all__ = ["deadline_in", "seconds_left"]


def deadline_in(timeout_s: float | None) -> float | None:
    """The monotonic time `timeout_s` from now; None (no deadline) for None."""
    return None if timeout_s is None else time.monotonic() + timeout_s


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until `deadline`, never negative; None (wait without bound) for None."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
