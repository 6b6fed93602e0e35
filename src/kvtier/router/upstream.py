"""Forwarding to a replica, with failover before the first byte and SSE passthrough.

For each attempt: the policy chooses among healthy replicas minus those already failed for this
request (affinity is never re-applied to a dead replica), the decision is recorded, a `Lease`
holds the replica's load counters, and the original body is POSTed. An attempt fails over when
connecting fails or times out, the replica answers 500/502/503/504, or the connection drops
before the first body byte: nothing has reached the client yet, so another replica can serve it.
A replica that did not answer at all is marked suspect at once (other requests avoid it until
its next good health check); one that answered 5xx is only excluded for this request.

Once the first byte is relayed the request is committed: a streaming response cut by the replica
ends with an SSE error event (the client sees an error, never a hang); a client that disconnects
closes the upstream response (vLLM aborts the request). The lease is released on every path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from kvtier.errors import RoutingError
from kvtier.router.fleet import Fleet, Lease, Replica
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policies import Policy, RouteRequest

__all__ = ["Forward", "Upstream", "UpstreamFailed"]

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({500, 502, 503, 504})
_CONNECTION_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class UpstreamFailed(Exception):
    """Every eligible replica failed before the first byte."""


@dataclass(frozen=True, slots=True)
class Forward:
    """One request to forward: what the handler parsed, what the policy needs."""

    endpoint: str
    """Path on the replica, e.g. /v1/chat/completions."""
    body: bytes
    headers: Mapping[str, str]
    route: RouteRequest
    stream: bool
    arrived: float
    """`time.perf_counter()` at arrival (for latency metrics)."""


def sse_error(message: str, code: int) -> bytes:
    doc = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet, policy: Policy,
                 rng: random.Random, clock: Callable[[], float], metrics: RouterMetrics) -> None:
        self._session = session
        self._fleet = fleet
        self._policy = policy
        self._rng = rng
        self._clock = clock
        self._metrics = metrics

    async def forward(self, request: web.Request, fwd: Forward) -> web.StreamResponse:
        """Serve `fwd` from some replica; raises RoutingError or UpstreamFailed if none can."""
        excluded: set[str] = set()
        last_error = ""
        for _ in range(len(self._fleet)):
            now = self._clock()
            try:
                decision = self._policy.choose(fwd.route, self._fleet.views(excluded),
                                               self._rng, now)
            except RoutingError:
                if not excluded:
                    raise
                break
            self._policy.observe_routed(fwd.route, decision, now)
            self._metrics.decisions.labels(self._metrics.strategy, decision.reason).inc()
            replica = self._fleet[decision.replica]
            self._metrics.routed.labels(replica.name).inc()
            uncached = fwd.route.prompt_tokens - decision.cached_tokens
            with self._fleet.lease(replica, uncached) as lease:
                self._metrics.overhead.observe(time.perf_counter() - fwd.arrived)
                try:
                    return await self._attempt(request, fwd, replica, lease)
                except _Retry as retry:
                    last_error = f"{replica.name}: {retry}"
                    if retry.unreachable:
                        replica.healthy = False  # suspect until its next good health check
            log.warning("failing over off %s", last_error)
            excluded.add(replica.name)
            self._metrics.failovers.labels(replica.name).inc()
        raise UpstreamFailed(f"every eligible replica failed; last: {last_error}")

    async def _attempt(self, request: web.Request, fwd: Forward, replica: Replica,
                       lease: Lease) -> web.StreamResponse:
        url = replica.config.url + fwd.endpoint
        try:
            async with self._session.post(url, data=fwd.body, headers=fwd.headers) as resp:
                if resp.status in RETRY_STATUSES:  # it answers: fail over, but keep it
                    raise _Retry(f"HTTP {resp.status}", unreachable=False)
                first = await resp.content.readany()
                if not first and resp.content.at_eof() and resp.content_length != 0:
                    raise _Retry("closed before the first byte")
                lease.first_byte()
                self._metrics.first_byte.labels(fwd.endpoint).observe(
                    time.perf_counter() - fwd.arrived)
                headers = _passthrough(resp, replica)
                if not fwd.stream or resp.status != 200:
                    rest = await resp.read()
                    return web.Response(status=resp.status, body=first + rest, headers=headers)
                out = web.StreamResponse(status=resp.status, headers=headers)
                await self._relay(request, resp, out, first)
                return out
        except _CONNECTION_ERRORS as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse,
                     out: web.StreamResponse, first: bytes) -> None:
        """Copy the SSE body chunk by chunk; committed: no exception escapes as a retry."""
        try:
            await out.prepare(request)
            await out.write(first)
        except _CONNECTION_ERRORS:
            self._metrics.stream_errors.labels("client").inc()
            return
        chunks = resp.content.iter_any()
        try:
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except _CONNECTION_ERRORS as exc:  # the replica died or went silent
                    self._metrics.stream_errors.labels("upstream").inc()
                    await out.write(sse_error(f"replica failed mid-stream: {exc}", 502))
                    break
                await out.write(chunk)
            await out.write_eof()
        except _CONNECTION_ERRORS:  # writes failed: the client went away
            self._metrics.stream_errors.labels("client").inc()
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            self._metrics.stream_errors.labels("client").inc()
            raise


class _Retry(Exception):
    """This attempt failed before any byte reached the client."""

    def __init__(self, message: str, unreachable: bool = True) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        """The replica did not answer (connect, reset, timeout): other requests avoid it too."""


# The body is relayed as raw bytes (no decompression), so Content-Encoding passes through.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                         "date", "server"})


def _passthrough(resp: aiohttp.ClientResponse, replica: Replica) -> dict[str, str]:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers["x-kvtier-replica"] = replica.name
    return headers
