"""Active health checks: `GET /health` on every replica every `health_interval_s`.

A replica is down after `unhealthy_after` consecutive failed checks: it leaves the candidate set
and `on_down(name)` purges what the router knew of its cache (a restart empties it). One good
check brings it back; its /v1/models is then (re)read for model ids and `max_model_len`.
A failed forward marks a replica suspect at once (`healthy = False`, no purge) so concurrent
requests avoid it until the next good check.

Owner: the router app; `run()` is one asyncio task, cancelled on shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from kvtier.router.replicas import Fleet, Replica

__all__ = ["HealthChecker"]


class HealthChecker:
    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet, interval_s: float,
                 timeout_s: float, unhealthy_after: int,
                 on_down: Callable[[str], None]) -> None:
        self._session = session
        self._fleet = fleet
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._unhealthy_after = unhealthy_after
        self._on_down = on_down

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self._fleet))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_all()

    async def _check(self, replica: Replica) -> None:
        ok = await self._get_ok(replica.config.url + "/health")
        if ok:
            if not replica.healthy or not replica.models:
                await self._learn_models(replica)
            replica.failed_checks = 0
            replica.healthy = True
            return
        replica.failed_checks += 1
        replica.healthy = False
        if replica.failed_checks == self._unhealthy_after:
            self._on_down(replica.name)

    async def _get_ok(self, url: str) -> bool:
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _learn_models(self, replica: Replica) -> None:
        try:
            async with self._session.get(replica.config.url + "/v1/models",
                                         timeout=self._timeout) as resp:
                doc = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return
        entries = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            return
        replica.models = tuple(str(e["id"]) for e in entries
                               if isinstance(e, dict) and "id" in e)
        lens = [e["max_model_len"] for e in entries
                if isinstance(e, dict) and isinstance(e.get("max_model_len"), int)]
        replica.max_model_len = min(lens) if lens else None
