"""One HTTP exchange as the router sees it, over ASGI (served by uvicorn with httptools).

Why ASGI on uvicorn rather than aiohttp's server: with the same upstream client, a bare proxy
adds clearly less latency on uvicorn's httptools protocol with a bare ASGI callable
(docs/router.md, "HTTP path", has the figures).

`Exchange` wraps the scope and the receive/send callables: headers, the body under a size cap,
whole or streamed responses, and `cancel_on_disconnect`, which turns a client hanging up into
the cancellation of the work done for it (the upstream answer is then closed, and vLLM aborts).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, TypeVar

import uvicorn

__all__ = ["BodyTooLarge", "ClientGone", "Exchange", "Header", "fast_loop_factory", "server"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Header = tuple[bytes, bytes]
T = TypeVar("T")

JSON_HEADERS: list[Header] = [(b"content-type", b"application/json")]


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


class ClientGone(Exception):
    """The client hung up before its answer was complete."""


class Exchange:
    __slots__ = ("_receive", "_send", "client_gone", "done", "headers", "method", "path", "started")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
        }
        """Request headers by lower-case name (a repeated header keeps its last value)."""
        self.started = False
        """True once the status line is sent: errors can no longer be answered."""
        self.done = False
        """True once the last body byte is handed to the server."""
        self.client_gone = False
        """True once a disconnect cancelled the work (`cancel_on_disconnect`)."""

    async def body(self, limit: int) -> bytes:
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise BodyTooLarge(limit)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise BodyTooLarge(limit)
            parts.append(part)
            if not message.get("more_body"):
                return b"".join(parts)

    async def respond(self, status: int, body: bytes, headers: Iterable[Header]) -> None:
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))],
            }
        )
        self.done = True
        await self._send({"type": "http.response.body", "body": body})

    async def respond_json(self, status: int, doc: object) -> None:
        await self.respond(status, json.dumps(doc).encode(), JSON_HEADERS)

    async def start(self, status: int, headers: Iterable[Header]) -> None:
        """Begin a streamed response (chunked transfer encoding)."""
        self.started = True
        await self._send(
            {"type": "http.response.start", "status": status, "headers": list(headers)}
        )

    async def write(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def finish(self) -> None:
        self.done = True
        await self._send({"type": "http.response.body", "body": b""})

    async def cancel_on_disconnect(self, work: Awaitable[T]) -> T:
        """Await `work` (after the body was read); if the client hangs up before the answer is
        complete, cancel it and raise ClientGone."""
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(self._watch(task))
        try:
            return await work
        except asyncio.CancelledError:
            if self.client_gone and task.uncancel() == 0:
                raise ClientGone from None
            raise
        finally:
            watcher.cancel()

    async def _watch(self, task: asyncio.Task[Any]) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.done:  # (a complete answer also reads as a disconnect)
            self.client_gone = True
            task.cancel()


def fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory when present (faster; a vLLM dependency), else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def server(app: Callable[..., Awaitable[None]], host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for the ASGI `app` (no lifespan, no access log, no proxy headers)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http="httptools",
        interface="asgi3",
        lifespan="off",
        proxy_headers=False,
        server_header=False,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)
