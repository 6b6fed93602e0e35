"""Forwarding to a replica, with failover before the first byte and SSE passthrough.

For each attempt: the policy chooses among healthy replicas minus those already failed for this
request (affinity is never re-applied to a dead replica), the decision is recorded, a `LoadClaim`
holds the replica's load counters, and the original body is POSTed. An attempt fails over when
connecting fails or times out, the replica answers 500/502/503/504, or the connection drops
before anything reached the client (a stream: before its first byte; a whole answer: before it
was complete, or past `HELD_ANSWER_BYTES`, from when it is relayed), so another replica can
serve it. The replica may then have generated part or
all of the answer for nothing: failover trades that work for an answer instead of a 502.
Failover is free while the request never reached a replica (no connection) or was refused
unserved (a stopping replica, below); once a replica got it and failed (a reset, a 5xx, a cut),
it fails over once more at most (`DELIVERED_FAILOVERS`): a request that kills the engine it
reaches (a query of death) reaches two replicas, not the whole fleet. A replica that got the
request and sent nothing for the client's read timeout (`read_timeout_s`) answers 504: it may
only be slow (a long whole answer), so the request is not generated again elsewhere, nor the
replica marked. A replica that took no connection is marked suspect at once (other requests
avoid it until its next good health check) unless it is the last in rotation (a fleet emptied
by one failed connect would answer 503 to every request until the next check); one that failed
after it got the request is only excluded for this request (the fault may be the request's). A
replica that refused the request as a stopping vLLM does while it drains (a 500 saying its
executor shut down, an answer aborted before any token, a stream that ends before its first
choice) is marked `stopping`: out of rotation until the health checker finds it answering a
completion again or gone, so the requests of its drain go straight elsewhere instead of one
extra hop each. A request whose replica the health checker gave up on (stalled, or
unreachable) is abandoned (its task cancelled, the claim marked with why): before its first
byte it fails over the same way; a stream under way ends with an error event naming why.

Once the first byte is relayed the request is committed: a streaming response cut by the replica
ends with an SSE error event (the client sees an error, never a hang); a client that disconnects
cancels the forward (`Exchange.cancel_on_disconnect`), which aborts the upstream connection
(vLLM aborts the request). The claim is released on every path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

from kvtier.core.errors import RoutingError
from kvtier.net.http_client import CONTROL_ANSWER_BYTES, ConnectFailed, HttpPool, Response
from kvtier.net.http_server import Exchange, Header
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policies import Decision, Policy, RouteRequest, work_tokens
from kvtier.router.replicas import LoadClaim, Replica, ReplicaSet

__all__ = [
    "DELIVERED_FAILOVERS",
    "Forward",
    "Upstream",
    "UpstreamFailed",
    "UpstreamTimedOut",
    "reported_usage",
]

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({500, 502, 503, 504})
HELD_ANSWER_BYTES = 4 << 20
"""The most of a whole (non-streamed) answer held before relaying it. An answer within it is
checked before the client sees it (an abort or a cut fails over); a larger one (long logprobs)
is relayed as it comes, so a request holds at most this much of the router's memory."""
DELIVERED_FAILOVERS = 1
"""Failovers a request gets once an attempt failed after its replica got it (a reset, a 5xx, an
answer cut before the client had any of it). Failing over off a replica that took no connection,
or refused the request unserved as a stopping vLLM does, is free."""


class UpstreamFailed(Exception):
    """Every eligible replica failed before the first byte."""


class UpstreamTimedOut(Exception):
    """The replica got the request, then sent nothing for the read timeout, before the client
    had any of the answer (a 504). It may only be slow (a whole answer longer than the
    timeout): neither resent, to be generated again elsewhere, nor the replica marked (the
    health checks and stall probes judge it)."""


def _timed_out(replica: Replica, exc: TimeoutError) -> UpstreamTimedOut:
    log.warning("replica %s timed out on a request: %s", replica.name, exc)
    return UpstreamTimedOut(f"replica {replica.name} timed out: {exc}")


class Forward(NamedTuple):
    """One request to forward: what the handler parsed, what the policy needs."""

    endpoint: str
    """Path on the replica, e.g. /v1/chat/completions."""
    body: bytes
    headers: Sequence[tuple[str, str]]
    route: RouteRequest
    stream: bool
    arrived: float
    """`time.perf_counter()` at arrival (for latency metrics)."""


_ABORTED = re.compile(rb'"finish_reason"\s*:\s*"abort"')
"""An answer cut short by the replica (vLLM aborts the requests in flight when it stops)."""
_SHUT_DOWN = re.compile(rb"cannot schedule new futures after shutdown")
"""vLLM's 500 to a request it must tokenize (a text prompt, a chat) once it is stopping."""
_NO_CHOICE = re.compile(rb'\s*data: \{[^\n]*"choices"\s*:\s*\[\s*\]')
"""An SSE event with no choice: only the usage event that ends a stream has none."""
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def reported_usage(body: bytes) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) of the last `usage` object in an answer or in the
    tail of a stream (vLLM puts it last), or None without one. A string value cannot fake it:
    quotes inside JSON strings are escaped."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    prompt = _PROMPT_TOKENS.search(body, at)
    if prompt is None:
        return None
    cached = _CACHED_TOKENS.search(body, at)
    return int(prompt.group(1)), int(cached.group(1)) if cached else 0


def sse_error(message: str, code: int, after: bytes = b"") -> bytes:
    """An SSE error event to send after `after`, the last bytes relayed: when a replica cut its
    stream mid-event, a blank line first ends the half event, so the error parses on its own."""
    doc = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    event = b"data: " + json.dumps(doc).encode() + b"\n\n"
    if after and not after.endswith((b"\n\n", b"\r\n\r\n")):
        return b"\n\n" + event
    return event


class Upstream:
    def __init__(
        self,
        pool: HttpPool,
        replicas: ReplicaSet,
        policy: Policy,
        rng: random.Random,
        clock: Callable[[], float],
        metrics: RouterMetrics,
    ) -> None:
        self._pool = pool
        self._replicas = replicas
        self._policy = policy
        self._rng = rng
        self._clock = clock
        self._metrics = metrics

    async def forward(self, exchange: Exchange, fwd: Forward) -> int:
        """Serve `fwd` from some replica and return the status; raises RoutingError or
        UpstreamFailed if none can."""
        if not len(self._replicas):  # (discovery found none yet, or every one left)
            raise RoutingError("no healthy replica")
        excluded: set[str] = set()
        last_error = ""
        delivered = 0  # attempts that failed after their replica got the request
        for _ in range(len(self._replicas)):
            now = self._clock()
            try:
                decision = self._policy.choose(
                    fwd.route, self._replicas.views(excluded), self._rng, now
                )
            except RoutingError:
                if not excluded:
                    raise
                break
            replica = self._replicas[decision.replica]
            work = work_tokens(fwd.route, decision)
            task = asyncio.current_task()
            with self._replicas.claim(replica, work, task) as claim:
                self._metrics.overhead.observe(time.perf_counter() - fwd.arrived)
                try:
                    return await self._attempt(
                        exchange,
                        fwd,
                        replica,
                        claim,
                        decision.cached_tokens,
                        partial(self._routed, fwd.route, decision, now),
                    )
                except _Retry as retry:
                    last_error = f"{replica.name}: {retry}"
                    if retry.stopping:
                        if not replica.stopping:
                            self._mark_stopping(replica, str(retry))
                        replica.healthy = False  # out until it answers a probe
                    elif not retry.delivered:
                        if self._replicas.others_in_rotation(replica):
                            replica.healthy = False  # suspect until a good check
                    else:
                        delivered += 1
                except asyncio.CancelledError:
                    # committed (a stream under way: `_relay` ended it), or the client gone:
                    # never resent; else abandoned by the health checker alone: fail over
                    if claim.relaying or exchange.started or not _abandoned_alone(claim, exchange):
                        raise
                    last_error = f"{replica.name}: {claim.abandoned}"
            if delivered > DELIVERED_FAILOVERS:
                raise UpstreamFailed(
                    f"{delivered} replicas failed the request after receiving it; "
                    f"last: {last_error}"
                )
            log.warning("failing over off %s", last_error)
            excluded.add(replica.name)
            self._metrics.failovers.labels(replica.name).inc()
        raise UpstreamFailed(f"every eligible replica failed; last: {last_error}")

    def _routed(self, route: RouteRequest, decision: Decision, now: float) -> None:
        """Record a decision acted upon: run once its request is on its way to the replica,
        before anything else runs (`HttpPool.request`), so it overlaps the replica's work and
        the next decision sees it."""
        self._policy.observe_routed(route, decision, now)
        self._metrics.decisions.inc(self._metrics.strategy, decision.reason)
        self._metrics.routed.inc(decision.replica)

    def _mark_stopping(self, replica: Replica, why: str) -> None:
        replica.stopping = True
        self._metrics.stopping.labels(replica.name).inc()
        log.warning("replica %s stopping (%s): out of rotation while it drains", replica.name, why)

    async def _attempt(
        self,
        exchange: Exchange,
        fwd: Forward,
        replica: Replica,
        claim: LoadClaim,
        predicted: int,
        on_way: Callable[[], None],
    ) -> int:
        try:
            resp = await self._pool.post(
                replica.settings.url, fwd.endpoint, fwd.body, fwd.headers, on_way
            )
        except ConnectFailed as exc:  # never sent
            raise _Retry(f"{type(exc).__name__}: {exc}", delivered=False) from exc
        except TimeoutError as exc:
            raise _timed_out(replica, exc) from exc
        except OSError as exc:
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        try:
            if resp.status in RETRY_STATUSES:  # it answers: fail over, but keep it
                if resp.status == 500 and await _says_shut_down(resp):
                    raise _Retry("HTTP 500", stopping=True)
                raise _Retry(f"HTTP {resp.status}")
            try:
                first = await resp.chunk()
            except TimeoutError as exc:
                raise _timed_out(replica, exc) from exc
            except OSError as exc:
                raise _Retry(f"{type(exc).__name__}: {exc}") from exc
            if fwd.stream and resp.status == 200 and _refused_stream(first):
                raise _Retry("it ended the stream before any token", stopping=True)
            claim.first_byte()
            now = time.perf_counter()
            self._metrics.first_byte.observe(now - fwd.arrived, fwd.endpoint)
            headers = _passthrough(resp.headers, replica)
            if not fwd.stream or resp.status != 200:
                try:
                    held, whole = await _hold(resp, first)
                except TimeoutError as exc:
                    raise _timed_out(replica, exc) from exc
                except OSError as exc:  # nothing sent yet: still a retry
                    raise _Retry(f"{type(exc).__name__}: {exc}") from exc
                if whole:
                    tail = b"".join(held)
                    if resp.status == 200 and _ABORTED.search(tail):  # nothing sent: retry
                        raise _Retry("it aborted the request before any token", stopping=True)
                    await exchange.respond(resp.status, tail, headers)
                else:
                    tail = await self._relay_whole(exchange, resp, held, headers)
            else:
                self._metrics.observe_ttft(now - fwd.arrived, fwd.endpoint, now)
                await exchange.start(resp.status, headers)
                tail = await self._relay(exchange, resp, first, claim)
            usage = reported_usage(tail) if resp.status == 200 else None
            if usage is not None:
                self._metrics.observe_usage(replica.name, predicted, *usage)
            return resp.status
        finally:
            resp.close()

    async def _relay(
        self, exchange: Exchange, resp: Response, first: bytes, claim: LoadClaim
    ) -> bytes:
        """Copy the SSE body chunk by chunk; committed: no exception escapes as a retry.
        Returns the last three chunks (the usage event, split or not, and `[DONE]`)."""
        chunk = first
        tail = (b"", b"", b"")
        claim.relaying = True
        try:
            while chunk:
                if _ABORTED.search(chunk):  # cut short by the replica: not a complete answer
                    self._metrics.stream_errors.labels("upstream").inc()
                    error = sse_error("the replica aborted the request", 502, tail[2])
                    await exchange.write(error)
                    break
                tail = (tail[1], tail[2], chunk)
                await exchange.write(chunk, complete=_ends_stream(tail))
                try:
                    chunk = await resp.chunk()
                    claim.progress()
                except OSError as exc:  # the replica died or went silent
                    self._metrics.stream_errors.labels("upstream").inc()
                    error = sse_error(f"replica failed mid-stream: {exc}", 502, tail[2])
                    await exchange.write(error)
                    break
            await exchange.finish()
            return b"".join(tail)
        except asyncio.CancelledError:  # the client went away, or the replica was given up
            if not _abandoned_alone(claim, exchange):
                self._metrics.stream_errors.labels("client").inc()
                raise
            self._metrics.stream_errors.labels("upstream").inc()
            await exchange.write(sse_error(f"replica {claim.abandoned}", 504, tail[2]))
            await exchange.finish()
            return b"".join(tail)

    async def _relay_whole(
        self, exchange: Exchange, resp: Response, held: list[bytes], headers: list[Header]
    ) -> bytes:
        """Relay a whole answer too large to hold (`HELD_ANSWER_BYTES`) as it comes, chunked;
        committed: a replica failing mid-way drops the client's connection, the one way left
        to tell it the body is incomplete. Returns the last two chunks (the usage, split or
        not)."""
        await exchange.start(resp.status, headers)
        tail = (b"", b"")
        for chunk in held:
            await exchange.write(chunk)
            tail = (tail[1], chunk)
        try:
            while chunk := await resp.chunk():
                await exchange.write(chunk)
                tail = (tail[1], chunk)
        except OSError as exc:  # the replica died or went silent
            self._metrics.stream_errors.labels("upstream").inc()
            log.warning("replica failed mid-answer, client connection dropped: %s", exc)
            exchange.abort()
            return b""
        await exchange.finish()
        return b"".join(tail)


def _abandoned_alone(claim: LoadClaim, exchange: Exchange) -> bool:
    """On a cancellation: whether it is the health checker abandoning `claim`
    (`LoadClaim.abandon`) and nothing else. The abandonment's cancel is taken back here, and
    only here (once per claim: `_relay` for a stream under way, else `Upstream.forward`); a
    client's hang-up or the router's stop, in the same loop turn or not, is never swallowed."""
    if claim.abandoned is None:
        return False
    task = asyncio.current_task()
    return task is not None and task.uncancel() == 0 and not exchange.client_gone


async def _hold(resp: Response, first: bytes) -> tuple[list[bytes], bool]:
    """A whole answer's chunks from `first` on, until its end (True) or until they pass
    `HELD_ANSWER_BYTES` (False: the rest is still to read)."""
    held = [first]
    size = len(first)
    while size <= HELD_ANSWER_BYTES:
        chunk = await resp.chunk()
        if not chunk:
            return held, True
        held.append(chunk)
        size += len(chunk)
    return held, False


async def _says_shut_down(resp: Response) -> bool:
    """Whether an error answer is vLLM's refusal once it is stopping (see `_SHUT_DOWN`)."""
    try:
        return _SHUT_DOWN.search(await resp.read(CONTROL_ANSWER_BYTES)) is not None
    except OSError:
        return False


def _refused_stream(first: bytes) -> bool:
    """Whether a stream's first chunk ends it without a token: `[DONE]`, or an event with no
    choice (the usage event, which only ends a stream), or an abort. vLLM draining refuses a
    new request so; nothing has reached the client yet. (A request asks for 1 token at least.)"""
    return (
        first.strip() == b"data: [DONE]"
        or _NO_CHOICE.match(first) is not None
        or _ABORTED.search(first) is not None
    )


def _ends_stream(tail: tuple[bytes, bytes, bytes]) -> bool:
    """Whether the last chunks end with SSE's `data: [DONE]` event (a client may hang up
    right after it, before the body's end)."""
    return b"".join(tail).rstrip().endswith(b"data: [DONE]")


class _Retry(Exception):
    """This attempt failed before any byte reached the client."""

    def __init__(self, message: str, delivered: bool = True, stopping: bool = False) -> None:
        super().__init__(message)
        self.delivered = delivered
        """The replica got the request (False: no connection; other requests avoid it too)."""
        self.stopping = stopping
        """The replica refused it as a draining vLLM does: out of rotation (`Replica.stopping`);
        it did none of the work, so the failover is free."""


# The body is relayed as raw bytes (no decompression), so Content-Encoding passes through.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"content-length",
        b"date",
        b"server",
    }
)
"""The replica's headers that are about its connection to the router (with `date` and
`server`, which the router's own server sets), never relayed; so are those its `Connection`
header names."""


def _passthrough(headers: list[Header], replica: Replica) -> list[Header]:
    dropped = _HOP_BY_HOP
    for name, value in headers:
        if name.lower() == b"connection":
            dropped = dropped | {token.strip().lower() for token in value.split(b",")}
    kept = [(name, value) for name, value in headers if name.lower() not in dropped]
    kept.append((b"x-kvtier-replica", replica.name.encode("latin-1")))
    return kept
