"""Running a test's asynchronous scenario from a synchronous test, bounded in time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def run(scenario: Awaitable[T], timeout_s: float = 60.0) -> T:
    """Run `scenario` on a fresh event loop; a hang fails the test after `timeout_s`."""

    async def bounded() -> T:
        return await asyncio.wait_for(scenario, timeout_s)

    return asyncio.run(bounded())
