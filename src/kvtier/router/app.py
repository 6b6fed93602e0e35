"""The router's HTTP face: OpenAI-compatible endpoints in front of N vLLM replicas.

    POST /v1/completions, /v1/chat/completions   validated, tokenized, routed, forwarded
                                                 (SSE streamed through byte for byte)
    GET  /v1/models                              a healthy replica's answer
    GET  /health                                 200 while a replica is up, else 503
    GET  /metrics                                Prometheus text (`kvtier.router.metrics`)

Bad input (malformed JSON, missing or mistyped fields, unknown model, a prompt longer than the
replicas accept) is answered 4xx with an OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; any unexpected fault becomes a 500 with the
same shape, never a crashed router. With an API key, `/v1/*` needs `Authorization: Bearer KEY`.

`Router` owns everything with a lifetime (client session, health task, event feed) and stops
it in the app's cleanup; `serve()` runs it until cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.errors import RoutingError
from kvtier.router.config import RouterConfig
from kvtier.router.events import EventFeed
from kvtier.router.fleet import Fleet
from kvtier.router.health import HealthChecker
from kvtier.router.index import PrefixIndex
from kvtier.router.metrics import CONTENT_TYPE, RouterMetrics
from kvtier.router.policies import CostPolicy, RouteRequest, make_policy
from kvtier.router.tokenize import Prompt, PromptError, Tokenizer
from kvtier.router.upstream import Forward, Upstream, UpstreamFailed

__all__ = ["Router", "error_response", "serve"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# field -> (accepted types, description) for the OpenAI fields the router reads or checks
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"),
    "stream": ((bool,), "a boolean"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "user": ((str,), "a string"),
    "cache_salt": ((str,), "a string"),
    "stop": ((str, list), "a string or a list of strings"),
}


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> web.Response:
    doc = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(doc, status=status)


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _check_types(body: Mapping[str, Any]) -> None:
    for field, (types, what) in _TYPES.items():
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise BadRequest(400, f"'{field}' must be {what}", field)
    for field in ("max_tokens", "max_completion_tokens", "n"):
        if body.get(field) is not None and body[field] < 1:
            raise BadRequest(400, f"'{field}' must be at least 1", field)


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.fleet = Fleet(config.replicas)
        self.index = PrefixIndex(config.max_blocks)
        """Event-fed index (kvaware); the other strategies keep their own."""
        options: dict[str, object] = {}
        if config.strategy in ("prefixaware", "kvaware", "prefixonly"):
            options["max_blocks"] = config.max_blocks
        if config.strategy == "kvaware":
            options["index"] = self.index
        self.policy = make_policy(config.strategy, **options)
        self.rng = random.Random(config.seed)
        self.clock = time.monotonic
        self.metrics = RouterMetrics(self.fleet, config.strategy, self._index_sizes)
        self.tokenizer = tokenizer
        self._session: aiohttp.ClientSession | None = None
        self._upstream: Upstream | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._feed: EventFeed | None = None

    # ----- lifetime -----

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._middleware])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        if self.tokenizer is None:
            from kvtier.model import resolve_model
            self.tokenizer = Tokenizer(resolve_model(self.config.model_dir),
                                       self.config.block_tokens)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            auto_decompress=False)
        self._upstream = Upstream(self._session, self.fleet, self.policy, self.rng, self.clock,
                                  self.metrics)
        health = HealthChecker(self._session, self.fleet, self.config.health_interval_s,
                               self.config.health_timeout_s, self.config.unhealthy_after,
                               lambda name: self.forget(name, "down"))
        await health.check_all()
        self._tasks.append(asyncio.create_task(health.run()))
        vllm_events = {r.name: r.vllm_events for r in self.config.replicas if r.vllm_events}
        if self.config.strategy == "kvaware" and (self.config.events or vllm_events):
            self._feed = EventFeed(self.index, self.config.events, vllm_events, self.forget,
                                   self._count_event, self.clock, self.config.max_blocks)
            self._feed.start()

    async def _stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._feed is not None:
            await self._feed.close()
        if self._session is not None:
            await self._session.close()

    def forget(self, replica: str, cause: str) -> None:
        """Purge what the router knows of a replica's cache (restart, clear, gone)."""
        self.policy.forget(replica)
        self.index.purge(replica)
        self.metrics.purges.labels(cause).inc()

    def _count_event(self, source: str, kind: str) -> None:
        self.metrics.events.labels(source, kind).inc()

    def _index_sizes(self) -> dict[str, int]:
        sizes = {"events": len(self.index)}
        if isinstance(self.policy, CostPolicy):
            sizes["routed"] = len(self.policy.speculative)
        return sizes

    # ----- middleware: auth, errors, request metrics -----

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        endpoint = request.path if request.path in _ENDPOINTS else "other"
        status = 500
        try:
            if self.config.api_key and request.path.startswith("/v1/"):
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {self.config.api_key}"
                                           .encode()):
                    response: web.StreamResponse = error_response(
                        401, "invalid or missing API key", type_="authentication_error",
                        code="invalid_api_key")
                    status = 401
                    return response
            try:
                response = await handler(request)
            except BadRequest as exc:
                response = error_response(exc.status, str(exc), param=exc.param, code=exc.code)
            except web.HTTPException as exc:  # 404/405/413 raised by aiohttp itself
                response = error_response(exc.status, exc.reason,
                                          type_="invalid_request_error")
            except RoutingError as exc:
                response = error_response(503, str(exc), type_="service_unavailable",
                                          code="no_healthy_replica")
            except UpstreamFailed as exc:
                response = error_response(502, str(exc), type_="upstream_error",
                                          code="upstream_failed")
            except asyncio.CancelledError:
                status = 499  # the client went away
                raise
            except Exception as exc:
                log.exception("unexpected error on %s", request.path)
                response = error_response(500, f"internal router error: {exc}",
                                          type_="internal_error")
            status = response.status
            return response
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    # ----- handlers -----

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, endpoint: str,
                        chat: bool) -> web.StreamResponse:
        arrived = time.perf_counter()
        raw = await request.read()
        body = self._parse(raw)
        prompt = self._prompt(body, chat)
        assert self.tokenizer is not None  # set in _start
        hashes = self.tokenizer.block_names(prompt, body.get("cache_salt"))
        self._check_length(body, prompt, chat)
        session = request.headers.get(self.config.session_header) or body.get("user")
        route = RouteRequest(hashes, self.config.block_tokens,
                             prompt.estimated_tokens, session)
        headers = {"Content-Type": "application/json",
                   "Accept-Encoding": request.headers.get("Accept-Encoding", "identity")}
        if not self.config.api_key and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]  # the replicas' own key
        fwd = Forward(endpoint, raw, headers, route, bool(body.get("stream", False)), arrived)
        assert self._upstream is not None
        return await self._upstream.forward(request, fwd)

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        _check_types(body)
        model = body.get("model")
        if model is None:
            raise BadRequest(400, "'model' is required", "model")
        served = self.fleet.models()
        if served and model not in served:
            raise BadRequest(404, f"the model '{model}' does not exist; served: "
                                  f"{', '.join(sorted(served))}", "model", "model_not_found")
        return body

    def _prompt(self, body: Mapping[str, Any], chat: bool) -> Prompt:
        assert self.tokenizer is not None
        field = "messages" if chat else "prompt"
        if field not in body:
            raise BadRequest(400, f"'{field}' is required", field)
        try:
            return self.tokenizer.prompt(body, chat)
        except PromptError as exc:
            raise BadRequest(400, str(exc), exc.param) from exc

    def _check_length(self, body: Mapping[str, Any], prompt: Prompt, chat: bool) -> None:
        limit = self.config.max_model_len or self.fleet.max_model_len()
        if limit is None:
            return
        wanted = body.get("max_completion_tokens") if chat else None
        wanted = wanted or body.get("max_tokens") or 0
        if prompt.max_tokens < limit and prompt.max_tokens + wanted <= limit:
            return  # fits even at one byte per token: no need to encode the tail
        assert self.tokenizer is not None
        prompt_tokens = len(self.tokenizer.tokens(prompt))
        if prompt_tokens >= limit or prompt_tokens + wanted > limit:
            raise BadRequest(400, f"This model's maximum context length is {limit} tokens. "
                                  f"However, you requested {prompt_tokens + wanted} tokens "
                                  f"({prompt_tokens} in the prompt, {wanted} for the "
                                  f"completion).", "messages" if chat else "prompt",
                             "context_length_exceeded")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        replicas = self.fleet.healthy()
        self.rng.shuffle(replicas)
        for replica in replicas:
            try:
                async with self._session.get(replica.config.url + "/v1/models") as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), status=200,
                                            content_type="application/json")
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
        raise RoutingError("no healthy replica answered /v1/models")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        healthy = [r.name for r in self.fleet.healthy()]
        doc = {"status": "ok" if healthy else "unavailable", "healthy_replicas": healthy,
               "replicas": len(self.fleet)}
        return web.json_response(doc, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                        "/metrics"})


async def serve(router: Router) -> None:
    """Run the router on its configured host and port until cancelled."""
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, router.config.host, router.config.port)
        await site.start()
        log.info("kvtier router on http://%s:%d (%s, %d replicas)", router.config.host,
                 router.config.port, router.config.strategy, len(router.fleet))
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
