"""The router's HTTP face: OpenAI-compatible endpoints in front of N vLLM replicas.

    POST /v1/completions, /v1/chat/completions   validated, tokenized, routed, forwarded
                                                 (SSE streamed through byte for byte)
    GET  /v1/models                              a healthy replica's answer
    GET  /health                                 200 while a replica is up, else 503
    GET  /metrics                                Prometheus text (`kvtier.router.metrics`)
    GET  /dashboard, /dashboard/data             live dashboard and its JSON feed
                                                 (`kvtier.router.dashboard`)

Bad input (malformed JSON, missing or mistyped fields, unknown model, a prompt longer than the
replicas accept) is answered 4xx with an OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; any unexpected fault becomes a 500 with the
same shape, never a crashed router. With an API key, `/v1/*` needs `Authorization: Bearer KEY`.

`Router` is the request handler (served by `kvtier.net.http_server`); it owns
everything with a lifetime (client session and pool, health task, event feed) between
`start()` and `stop()`. `serving()` runs it on a port; `serve()` until a signal stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.core.errors import ConfigError, RoutingError
from kvtier.net.http_client import CONTROL_ANSWER_BYTES, HttpPool
from kvtier.net.http_server import (
    JSON_HEADERS,
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    Exchange,
    HttpServer,
    Limits,
)
from kvtier.router.auth import ApiKeys, Denied
from kvtier.router.dashboard import Dashboard
from kvtier.router.discovery import ROUTE_KEY, ConsistentTies, Discovery
from kvtier.router.event_feed import EventFeed
from kvtier.router.health import HealthChecker
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import CONTENT_TYPE, RouterMetrics
from kvtier.router.openai_request import (
    BadRequest,
    parse_body,
    requested_tokens,
    requested_truncation,
)
from kvtier.router.policies import CostPolicy, RouteRequest, make_policy
from kvtier.router.replicas import ReplicaSet
from kvtier.router.settings import RouterSettings
from kvtier.router.tokenizer import Prompt, Tokenizer
from kvtier.router.upstream import Forward, Upstream, UpstreamFailed, UpstreamTimedOut

__all__ = ["Listening", "Router", "serve", "serving"]

log = logging.getLogger(__name__)

Handler = Callable[[Exchange], Awaitable[int]]


def _allowed(method: str) -> str:
    """The methods a route of `method` accepts, as a 405's `Allow` lists them (RFC 9110)."""
    return "GET, HEAD" if method == "GET" else method


class Router:
    def __init__(self, config: RouterSettings, tokenizer: Tokenizer | None = None) -> None:
        """`tokenizer` replaces the one built from `config.model_dir` (tests share one)."""
        if tokenizer is None and config.model_dir is None:
            raise ConfigError(
                "model_dir: required: the router tokenizes with the model's own tokenizer"
            )
        self.config = config
        self.auth = ApiKeys(config.api_key, config.api_keys_file, config.shared_cache_tenants)
        self.replicas = ReplicaSet(config.replicas)
        self.index = PrefixIndex(config.max_blocks)
        """Event-fed index (kvaware); the other strategies keep their own."""
        options: dict[str, object] = {}
        if config.strategy in ("prefixaware", "kvaware", "prefixonly"):
            options["max_blocks"] = config.max_blocks
        if config.strategy == "kvaware":
            options["index"] = self.index
        self.policy = make_policy(config.strategy, **options)
        self.rng = (ConsistentTies if config.consistent_ties else random.Random)(config.seed)
        self.clock = time.monotonic
        self.metrics = RouterMetrics(self.replicas, config.strategy, self._index_sizes)
        self.dashboard = Dashboard(self.metrics, self.replicas)
        self.tokenizer = tokenizer
        self._pool: HttpPool | None = None
        self._upstream: Upstream | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._feed: EventFeed | None = None
        self.discovery: Discovery | None = None
        """Replicas found by DNS (`replicas_dns`), once started."""
        self._routes: dict[str, tuple[str, Handler]] = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            **self.dashboard.routes(),
        }

    # ----- lifetime -----

    async def start(self) -> None:
        if self.tokenizer is None:
            assert self.config.model_dir is not None  # checked in __init__
            self.tokenizer = Tokenizer(self.config.model_dir)
        tls = None
        if self.config.replica_ca_file is not None:
            try:
                tls = ssl.create_default_context(cafile=self.config.replica_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"replica_ca_file: cannot load {self.config.replica_ca_file}: {exc}"
                ) from exc
        self._pool = HttpPool(self.config.connect_timeout_s, self.config.read_timeout_s, tls=tls)
        self.dashboard.start(self._pool)
        self._upstream = Upstream(
            self._pool, self.replicas, self.policy, self.rng, self.clock, self.metrics
        )
        health = HealthChecker(
            self._pool,
            self.replicas,
            self.config.health_interval_s,
            self.config.health_timeout_s,
            self.config.unhealthy_after,
            lambda name: self.forget(name, "down"),
            self.config.stall_after_s,
            lambda name: self.metrics.stalls.labels(name).inc(),
            lambda name: self.metrics.unreachable.labels(name).inc(),
            self.config.models_refresh_s,
        )
        await health.check_all()
        self._tasks.append(asyncio.create_task(health.run()))
        vllm_events = {r.name: r.vllm_events for r in self.config.replicas if r.vllm_events}
        vllm_replay = {
            r.name: r.vllm_events_replay for r in self.config.replicas if r.vllm_events_replay
        }
        discovered_events = self.config.replicas_dns and (
            self.config.replica_events_port or self.config.replica_vllm_events_port
        )
        if self.config.strategy == "kvaware" and (
            self.config.events or vllm_events or discovered_events
        ):
            self._feed = EventFeed(
                self.index,
                self.config.events,
                vllm_events,
                self._count_event,
                self.clock,
                self.config.max_blocks,
                dynamic=bool(discovered_events),
                known=self.replicas.replicas.__contains__,
                curve_server_key=self.config.events_curve_server_key,
                adapter_path=lambda replica, name: self.replicas.adapter_path(name, replica),
                vllm_replay=vllm_replay,
            )
            self._feed.start()
        if self.config.replicas_dns is not None:
            self.discovery = Discovery(
                self.config,
                self.replicas,
                self._pool,
                health.check_all,
                self._drop,
                self._feed,
                self.clock,
            )
            await self.discovery.sync()
            self._tasks.append(asyncio.create_task(self.discovery.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._feed is not None:
            await self._feed.close()
        await self.dashboard.stop()
        if self._pool is not None:
            self._pool.close()

    def forget(self, replica: str, cause: str) -> None:
        """Purge what the router knows of a replica's cache (restart, clear, gone)."""
        self.policy.forget(replica)
        self.index.purge(replica)
        self.metrics.purges.labels(cause).inc()

    def _drop(self, replica: str, cause: str) -> None:
        """A replica left for good (discovery): forget it, and its series in /metrics."""
        self.forget(replica, cause)
        self.metrics.forget_replica(replica)

    def _count_event(self, source: str, kind: str) -> None:
        self.metrics.events.labels(source, kind).inc()

    def _index_sizes(self) -> dict[str, int]:
        sizes = {"events": len(self.index)}
        if isinstance(self.policy, CostPolicy):
            sizes["routed"] = len(self.policy.speculative)
        return sizes

    # ----- entry: routing by path, auth, errors, request metrics -----

    async def __call__(self, exchange: Exchange) -> None:
        started = time.perf_counter()
        route = self._routes.get(exchange.path)
        status = 500
        try:
            status = await self._answer(exchange, route)
        except ClientGone:
            status = 499
        finally:
            endpoint = exchange.path if route else "other"
            self.metrics.requests.inc(endpoint, str(status))
            self.metrics.latency.observe(time.perf_counter() - started, endpoint)

    async def _answer(self, exchange: Exchange, route: tuple[str, Handler] | None) -> int:
        """Run the handler; map every failure to an OpenAI error body. Returns the status."""
        try:
            if route is None:
                raise BadRequest(404, f"no such endpoint: {exchange.path}")
            method, handler = route
            if exchange.method != method and not (method == "GET" and exchange.method == "HEAD"):
                allowed = _allowed(method)
                raise BadRequest(405, f"{exchange.path} takes {allowed}, not {exchange.method}")
            if self.auth.enabled and exchange.path.startswith("/v1/"):
                try:
                    exchange.tenant = self.auth.authenticate(
                        exchange.headers.get("authorization", "")
                    )
                except Denied:
                    raise BadRequest(
                        401,
                        "invalid or missing API key",
                        code="invalid_api_key",
                        type_="authentication_error",
                    ) from None
            return await handler(exchange)
        except BadRequest as exc:
            error = exc
        except BodyTooLarge as exc:
            error = BadRequest(413, str(exc))
        except BodyTimeout as exc:
            error = BadRequest(408, str(exc))
        except RoutingError as exc:
            error = BadRequest(
                503, str(exc), code="no_healthy_replica", type_="service_unavailable"
            )
        except UpstreamFailed as exc:
            error = BadRequest(502, str(exc), code="upstream_failed", type_="upstream_error")
        except UpstreamTimedOut as exc:
            error = BadRequest(504, str(exc), code="upstream_timeout", type_="upstream_error")
        except ClientGone:
            raise
        except Exception as exc:
            log.exception("unexpected error on %s", exchange.path)
            error = BadRequest(500, f"internal router error: {exc}", type_="internal_error")
        if exchange.started:  # too late for an error body: the answer was under way
            return 500
        allow = [(b"allow", _allowed(route[0]).encode())] if error.status == 405 and route else []
        # the client may still be sending a body nobody will read: close after the answer
        await exchange.respond_json(
            error.status, error.body(), close=error.status in (408, 413, 431), headers=allow
        )
        return error.status

    # ----- handlers -----

    async def _completions(self, exchange: Exchange) -> int:
        return await self._generate(exchange, "/v1/completions", chat=False)

    async def _chat(self, exchange: Exchange) -> int:
        return await self._generate(exchange, "/v1/chat/completions", chat=True)

    async def _generate(self, exchange: Exchange, endpoint: str, chat: bool) -> int:
        arrived = time.perf_counter()
        raw = await exchange.body(self.config.max_body_bytes, self.config.client_timeout_s)
        body = parse_body(raw, chat=chat)
        # the tenant's own tokenizer caches: a hit on another tenant's text would answer sooner
        namespace = self.auth.tenant_salt(exchange.tenant)
        salt = self.auth.cache_salt(exchange.tenant, body.get("cache_salt"))
        if salt is not body.get("cache_salt"):  # the tenant's own cache namespace
            body["cache_salt"] = salt
            raw = msgspec.json.encode(body)
        self._check_model(body["model"])
        assert self.tokenizer is not None  # set in start()
        prompt = self.tokenizer.prompt(body, chat, namespace)
        truncation = requested_truncation(body)
        if truncation is not None:  # routed and checked as the replica will see it
            prompt = self.tokenizer.truncated(prompt, truncation, self._max_model_len())
        block_tokens = self.block_tokens
        # a LoRA adapter's blocks are keyed by its name (vLLM's `lora_name` is the request's
        # model) and its path
        path = self.replicas.adapter_path(body["model"])
        lora = None if path is None else (body["model"], path)
        hashes = (
            ()
            if block_tokens is None
            else self.tokenizer.block_hashes(prompt, block_tokens, body.get("cache_salt"), lora)
        )
        if self.config.consistent_ties:
            ROUTE_KEY.set(hashes[-1] if hashes else None)
        self._check_length(body, prompt, chat)
        session = exchange.headers.get(self.config.session_header.lower()) or body.get("user")
        route = RouteRequest(
            hashes, block_tokens or 1, prompt.estimated_tokens, session, exchange.tenant
        )
        # identity: the router reads the answer's bytes (usage, aborts, the stream's end), which
        # a compressing proxy in front of a replica would hide (vLLM itself never compresses)
        headers = [("Content-Type", "application/json"), ("Accept-Encoding", "identity")]
        headers += self._passed_key(exchange)
        fwd = Forward(endpoint, raw, headers, route, bool(body.get("stream", False)), arrived)
        assert self._upstream is not None
        return await exchange.cancel_on_disconnect(self._upstream.forward(exchange, fwd))

    def _passed_key(self, exchange: Exchange) -> list[tuple[str, str]]:
        """The client's Authorization header, passed on to the replicas (their key) when the
        router has no key of its own; else nothing."""
        if self.auth.enabled or "authorization" not in exchange.headers:
            return []
        return [("Authorization", exchange.headers["authorization"])]

    @property
    def block_tokens(self) -> int | None:
        """The engines' block size prompts are hashed by: configured, else the replicas'
        (None until a replica reported it: requests are then routed without prefix hashes)."""
        return self.config.block_tokens or self.replicas.block_tokens()

    def _check_model(self, model: str) -> None:
        served = self.replicas.models()
        if served and model not in served:
            raise BadRequest(
                404,
                f"the model '{model}' does not exist; served: {', '.join(sorted(served))}",
                "model",
                "model_not_found",
            )

    def _max_model_len(self) -> int | None:
        return self.config.max_model_len or self.replicas.max_model_len()

    def _check_length(self, body: Mapping[str, Any], prompt: Prompt, chat: bool) -> None:
        limit = self._max_model_len()
        if limit is None:
            return
        wanted = requested_tokens(body, chat=chat)
        bound = prompt.max_tokens
        if bound < limit and bound + wanted <= limit:
            return  # fits even at one byte per token: no need to encode the tail
        assert self.tokenizer is not None
        prompt_tokens = len(self.tokenizer.tokens(prompt))
        if prompt_tokens >= limit or prompt_tokens + wanted > limit:
            raise BadRequest(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, you requested {prompt_tokens + wanted} tokens "
                f"({prompt_tokens} in the prompt, {wanted} for the "
                f"completion).",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )

    async def _models(self, exchange: Exchange) -> int:
        assert self._pool is not None
        replicas = self.replicas.healthy()
        self.rng.shuffle(replicas)
        for replica in replicas:
            try:
                async with asyncio.timeout(self.config.health_timeout_s):
                    resp = await self._pool.get(
                        replica.settings.url, "/v1/models", self._passed_key(exchange)
                    )
                    try:
                        body = await resp.read(CONTROL_ANSWER_BYTES)
                    finally:
                        resp.close()
            except (TimeoutError, OSError):
                continue
            if resp.status == 200:
                await exchange.respond(200, body, JSON_HEADERS)
                return 200
        raise RoutingError("no healthy replica answered /v1/models")

    async def _health(self, exchange: Exchange) -> int:
        healthy = [r.name for r in self.replicas.healthy()]
        doc = {
            "status": "ok" if healthy else "unavailable",
            "healthy_replicas": healthy,
            "replicas": len(self.replicas),
        }
        status = 200 if healthy else 503
        await exchange.respond_json(status, doc)
        return status

    async def _metrics(self, exchange: Exchange) -> int:
        await exchange.respond(
            200, self.metrics.render(), [(b"content-type", CONTENT_TYPE.encode())]
        )
        return 200


@dataclass(frozen=True, slots=True)
class Listening:
    url: str
    """Base URL the router answers on."""
    closed: asyncio.Task[None]
    """Done when the server stops (SIGINT/SIGTERM, or leaving `serving`)."""


@contextlib.asynccontextmanager
async def serving(
    router: Router, host: str, port: int, drain_s: int = 2
) -> AsyncIterator[Listening]:
    """Start `router` and serve it on `host:port` (0: any free port) inside the block; a port
    that cannot be bound is a ConfigError naming it. Leaving the block, or on a signal, it stops
    accepting and waits up to `drain_s` for the requests in flight before cutting them."""
    try:
        sock = socket.create_server((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    with sock:
        await router.start()
        try:
            limits = Limits(
                router.config.max_header_bytes,
                router.config.client_timeout_s,
                router.config.max_connections,
            )
            http = HttpServer(router, limits, drain_s)
            task = asyncio.create_task(http.serve(sock))
            while not http.started:
                if task.done():
                    await task  # raises what stopped it
                    raise RuntimeError(f"the router could not serve on {host}:{port}")
                await asyncio.sleep(0.01)
            try:
                yield Listening(f"http://{host}:{sock.getsockname()[1]}", task)
            finally:
                http.stop()
                await task
        finally:
            await router.stop()


async def serve(router: Router) -> None:
    """Run the router on its configured host and port until a signal stops it; then the
    requests in flight have `drain_s` to finish."""
    config = router.config
    async with serving(router, config.host, config.port, config.drain_s) as listening:
        # The tokenizer and its imports (transformers; torch too where the caller's process
        # has it) are a large heap that lives as long as the process: keep the collector from
        # walking it again and again.
        gc.collect()
        gc.freeze()
        log.info(
            "kvtier router on %s (%s, %d replicas)",
            listening.url,
            config.strategy,
            len(router.replicas),
        )
        try:
            await asyncio.shield(listening.closed)
        finally:
            gc.unfreeze()  # so the interpreter's last collection reclaims it at exit
