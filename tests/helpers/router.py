"""In-process fake replicas and a router on loopback, for the router's unit tests.

A `FakeReplica` is a real aiohttp server on a free port that speaks enough of vLLM's API
(/health, /v1/models, completions with and without SSE) and misbehaves on demand: 500s, resets
before answering, hangs, streams that die half way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Self, TypeVar

import aiohttp
from aiohttp import web

from kvtier.tools.embedded_model import resolve_model
from kvtier.router.app import Router, serving
from kvtier.router.settings import ReplicaConfig, RouterConfig
from kvtier.router.tokenizer import Tokenizer

T = TypeVar("T")
MODEL = "smol"
MAX_MODEL_LEN = 2048
SSE_CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
              b"data: [DONE]\n\n"]

_TOKENIZER: Tokenizer | None = None


def tokenizer() -> Tokenizer:
    """The embedded model's tokenizer at 16-token blocks (loaded once per test process)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = Tokenizer(resolve_model(None), block_tokens=16)
    return _TOKENIZER


@dataclass
class FakeReplica:
    mode: str = "ok"
    """ok | error500 | reset | hang | die_mid_stream | slow_stream"""
    healthy: bool = True
    received: list[dict] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    """Set it to let a `slow_stream` replica send its last chunks."""
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> FakeReplica:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "max_model_len": MAX_MODEL_LEN}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        if self.mode == "error500":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(3600)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "text_completion",
                                      "choices": [{"text": "ok", "index": 0}],
                                      "served_by": self.url})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE_CHUNKS[0])
        if self.mode == "die_mid_stream":
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(3600)
        if self.mode == "slow_stream":
            await self.release.wait()
        for chunk in SSE_CHUNKS[1:]:
            await resp.write(chunk)
        await resp.write_eof()
        return resp


@dataclass
class RunningRouter:
    router: Router
    url: str
    client: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def running_router(replicas: list[FakeReplica], **options: object
                         ) -> AsyncIterator[RunningRouter]:
    """A router on a free port in front of `replicas`, plus a client session."""
    options.setdefault("health_interval_s", 0.2)
    options.setdefault("connect_timeout_s", 1.0)
    options.setdefault("seed", 0)
    config = RouterConfig(replicas=tuple(ReplicaConfig(r.url) for r in replicas), port=0,
                          block_tokens=16, **options)  # type: ignore[arg-type]
    router = Router(config, tokenizer=tokenizer())
    async with serving(router, "127.0.0.1", 0) as listening, \
            aiohttp.ClientSession() as client:
        yield RunningRouter(router, listening.url, client)


@contextlib.asynccontextmanager
async def fakes(*modes: str) -> AsyncIterator[list[FakeReplica]]:
    replicas = [await FakeReplica(mode=m).start() for m in modes]
    try:
        yield replicas
    finally:
        for r in replicas:
            await r.stop()


def free_endpoint() -> str:
    """A loopback ZMQ endpoint on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def completion(prompt: str = "hello world", **extra: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}


def sse_bytes(chunks: list[bytes] = SSE_CHUNKS) -> bytes:
    return b"".join(chunks)


def dumps(doc: object) -> bytes:
    return json.dumps(doc).encode()


class RouterThread:
    """A router serving from a background thread (for synchronous tests against real engines).

        with RouterThread(config) as rt:
            httpx.post(rt.url + "/v1/completions", ...)
    """

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None = None) -> None:
        self.router = Router(config, tokenizer=tokenizer)
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with serving(self.router, "127.0.0.1", 0) as listening:
            self.url = listening.url
            self._ready.set()
            await self._stop.wait()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the router's loop (its state is not thread-safe) and return its result."""
        assert self._loop is not None
        async def wrapped() -> T:
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapped(), self._loop).result(30)

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("router did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
