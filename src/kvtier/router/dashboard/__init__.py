"""The router's live dashboard: a page, its vendored script and style, and a JSON feed.

    GET /dashboard               the page (static/index.html; no external network: every asset
                                 ships in this package)
    GET /dashboard/app.js        the charts and fleet map (self-contained JS drawing SVG)
    GET /dashboard/style.css
    GET /dashboard/data          the fleet now and its whole history (`FleetSampler.document`)
    GET /dashboard/data/latest   the fleet now and the last few points (what the page polls)

The page polls `/dashboard/data/latest` every `interval_s`; `kvtier status` and the benchmark
reports read the same document. Sampling runs only while someone asks (see `sampler`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib import resources

from kvtier.net.http_client import HttpPool
from kvtier.net.http_server import JSON_HEADERS, Exchange
from kvtier.router.dashboard.sampler import FleetSampler
from kvtier.router.metrics import RouterMetrics
from kvtier.router.replicas import ReplicaSet

__all__ = ["Dashboard", "FleetSampler"]

Handler = Callable[[Exchange], Awaitable[int]]

LATEST_POINTS = 5
"""Points `/dashboard/data/latest` carries (the page de-duplicates by time)."""

_STATIC = {
    "/dashboard": ("index.html", b"text/html; charset=utf-8"),
    "/dashboard/": ("index.html", b"text/html; charset=utf-8"),
    "/dashboard/app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "/dashboard/style.css": ("style.css", b"text/css; charset=utf-8"),
}


class Dashboard:
    def __init__(self, metrics: RouterMetrics, replicas: ReplicaSet) -> None:
        self.sampler = FleetSampler(metrics, replicas)
        self._files = {
            path: (resources.files(__package__).joinpath("static", name).read_bytes(), kind)
            for path, (name, kind) in _STATIC.items()
        }

    def routes(self) -> dict[str, tuple[str, Handler]]:
        """Path -> (method, handler), for the router's route table."""
        out: dict[str, tuple[str, Handler]] = dict.fromkeys(self._files, ("GET", self._static))
        out["/dashboard/data"] = ("GET", self._data)
        out["/dashboard/data/latest"] = ("GET", self._latest)
        return out

    def start(self, pool: HttpPool) -> None:
        self.sampler.start(pool)

    async def stop(self) -> None:
        await self.sampler.stop()

    async def _static(self, exchange: Exchange) -> int:
        body, kind = self._files[exchange.path]
        await exchange.respond(
            200, body, [(b"content-type", kind), (b"cache-control", b"no-cache")]
        )
        return 200

    async def _data(self, exchange: Exchange) -> int:
        snap = await self.sampler.current()
        return await _json(exchange, self.sampler.document(snap, self.sampler.history))

    async def _latest(self, exchange: Exchange) -> int:
        snap = await self.sampler.current()
        points = list(self.sampler.history)[-LATEST_POINTS:]
        return await _json(exchange, self.sampler.document(snap, points))


async def _json(exchange: Exchange, doc: object) -> int:
    body = json.dumps(doc, separators=(",", ":")).encode()
    await exchange.respond(200, body, [*JSON_HEADERS, (b"cache-control", b"no-store")])
    return 200
