"""`Deadline`: the lazily moved timeout of a connection, on a real event loop."""

from __future__ import annotations

import asyncio

from kvtier.net.deadline import Deadline
from tests.helpers.aio import run


def test_it_fires_once_at_the_last_armed_deadline_not_the_first() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        deadline = Deadline(loop)
        start = loop.time()
        deadline.arm(0.05, lambda: times.append(loop.time()))
        await asyncio.sleep(0.03)
        deadline.arm(0.05, lambda: times.append(loop.time()))  # moved: the timer set is early
        await asyncio.sleep(0.2)
        assert len(times) == 1 and times[0] - start >= 0.079
        assert not deadline.armed

    run(scenario())


def test_a_sooner_deadline_fires_sooner_than_the_timer_already_set() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        deadline = Deadline(loop)
        start = loop.time()
        deadline.arm(10.0, lambda: times.append(-1.0))
        deadline.arm(0.03, lambda: times.append(loop.time()))
        await asyncio.sleep(0.2)
        assert len(times) == 1 and 0.029 <= times[0] - start < 0.15

    run(scenario())


def test_disarmed_or_closed_it_never_fires_and_rearms_after_a_disarm() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        disarmed, closed = Deadline(loop), Deadline(loop)
        for deadline in (disarmed, closed):
            deadline.arm(0.02, lambda: times.append(loop.time()))
        disarmed.disarm()
        closed.close()
        await asyncio.sleep(0.1)
        assert times == [] and not disarmed.armed and not closed.armed
        disarmed.arm(0.02, lambda: times.append(loop.time()))
        await asyncio.sleep(0.1)
        assert len(times) == 1

    run(scenario())
