"""In-process fake replicas and a router on loopback, for the router's unit tests.

Fake replicas are `kvtier.tools.fake_replica.FakeReplica` servers on free ports that speak
enough of vLLM's API and misbehave on demand (500s, resets, hangs, streams that die half way).
Clients are `httpx` (a test dependency only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Self, TypeVar

import httpx

from kvtier.router.app import Router, serving
from kvtier.router.settings import RouterSettings
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.fake_replica import SSE_CHUNKS, FakeReplica

__all__ = [
    "MAX_MODEL_LEN",
    "MODEL",
    "SSE_CHUNKS",
    "FakeReplica",
    "RouterThread",
    "RunningRouter",
    "completion",
    "dumps",
    "fakes",
    "free_endpoint",
    "running_router",
    "sse_bytes",
]

T = TypeVar("T")
MODEL = "smol"
MAX_MODEL_LEN = 2048
BLOCK_TOKENS = 16
"""The fake replicas' engine block size: small, so short test prompts span several blocks."""


@dataclass
class RunningRouter:
    router: Router
    url: str
    client: httpx.AsyncClient


@contextlib.asynccontextmanager
async def running_router(
    tokenizer: Tokenizer, replicas: Sequence[FakeReplica], **options: object
) -> AsyncIterator[RunningRouter]:
    """A router on a free port in front of `replicas`, plus a client."""
    options.setdefault("health_interval_s", 0.2)
    options.setdefault("connect_timeout_s", 1.0)
    options.setdefault("seed", 0)
    config = RouterSettings(replicas=[r.url for r in replicas], port=0, **options)
    router = Router(config, tokenizer=tokenizer)
    async with (
        serving(router, "127.0.0.1", 0) as listening,
        httpx.AsyncClient(timeout=60) as client,
    ):
        yield RunningRouter(router, listening.url, client)


@contextlib.asynccontextmanager
async def fakes(*modes: str, adapters: tuple[str, ...] = ()) -> AsyncIterator[list[FakeReplica]]:
    """Fake replicas serving `MODEL` (and the LoRA `adapters`), one per mode."""
    replicas = [
        await FakeReplica(
            mode=m,
            model=MODEL,
            max_model_len=MAX_MODEL_LEN,
            adapters=adapters,
            block_tokens=BLOCK_TOKENS,
        ).start()
        for m in modes
    ]
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


def completion(prompt: str | list[int] = "hello world", **extra: object) -> dict[str, object]:
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

    def __init__(self, config: RouterSettings, tokenizer: Tokenizer | None = None) -> None:
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
