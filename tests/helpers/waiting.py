"""Waiting, bounded, for what a test's processes do."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(check: Callable[[], object], timeout_s: float, what: str) -> None:
    """Return once `check()` is true; fail the test, naming `what`, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)
