"""One HTTP exchange as the router sees it, over ASGI (served by uvicorn with httptools).

Why ASGI on uvicorn rather than aiohttp's server: with the same upstream client, a bare proxy
adds clearly less latency on uvicorn's httptools protocol with a bare ASGI callable
(docs/router.md, "HTTP path", has the figures).

`Exchange` wraps the scope and the receive/send callables: headers, the body under a size cap
and a deadline, whole or streamed responses, and `cancel_on_disconnect`, which turns a client
hanging up into the cancellation of the work done for it (the upstream answer is then closed,
and vLLM aborts).

`GuardedHttp` is uvicorn's httptools protocol with bounds on the request head that uvicorn
does not have: its size (431) and the time to receive it (408), so a client trickling headers
byte by byte, or one that connects and never speaks, holds a connection for a bounded time and
a bounded number of bytes. With `Limits.max_connections` (uvicorn's `limit_concurrency`, a 503
beyond) and the body's own cap and deadline, clients cannot make the router hold more than
max_connections x (head + body limit) of request bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = [
    "BodyTimeout",
    "BodyTooLarge",
    "ClientGone",
    "Exchange",
    "GuardedHttp",
    "Header",
    "Limits",
    "fast_loop_factory",
    "server",
]

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


class BodyTimeout(Exception):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not received within {timeout_s:g} s")


class ClientGone(Exception):
    """The client hung up before its answer was complete."""


class Exchange:
    __slots__ = (
        "_receive",
        "_send",
        "client_gone",
        "done",
        "headers",
        "method",
        "path",
        "started",
        "tenant",
    )

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
        """True once the answer is complete as the client reads it: its last body byte, or
        the event that ends a stream (`write(..., complete=True)`), handed to the server."""
        self.client_gone = False
        """True once a disconnect cancelled the work (`cancel_on_disconnect`)."""
        self.tenant: str | None = None
        """The tenant of the request's API key (`kvtier.router.auth`); None: shared."""

    async def body(self, limit: int, timeout_s: float | None = None) -> bytes:
        """The whole body; BodyTooLarge beyond `limit` bytes, BodyTimeout when it takes longer
        than `timeout_s` to arrive."""
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise BodyTooLarge(limit)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read_body(limit)
        except TimeoutError:
            assert timeout_s is not None
            raise BodyTimeout(timeout_s) from None

    async def _read_body(self, limit: int) -> bytes:
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

    async def respond_json(self, status: int, doc: object, *, close: bool = False) -> None:
        """Answer `doc` as JSON; `close` ends the connection after it (the client may still
        be sending a request body nobody will read)."""
        headers = [*JSON_HEADERS, (b"connection", b"close")] if close else JSON_HEADERS
        await self.respond(status, json.dumps(doc).encode(), headers)

    async def start(self, status: int, headers: Iterable[Header]) -> None:
        """Begin a streamed response (chunked transfer encoding)."""
        self.started = True
        await self._send(
            {"type": "http.response.start", "status": status, "headers": list(headers)}
        )

    async def write(self, chunk: bytes, *, complete: bool = False) -> None:
        """Send a body chunk; `complete`: the client has its whole answer with it (SSE's
        `[DONE]`), so a hang-up after it is not a lost answer."""
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})
        self.done = self.done or complete

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


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may make the server hold (see the module docstring)."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 30.0
    max_connections: int | None = None


def _error_response(status: int, reason: str, message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounding the request head in size and time.

    Counts the bytes received while a request's head is incomplete (a chunk that completes the
    head may carry body bytes: those are not held against it) and arms a timer from the
    connection's start, or a later request's first byte, until the head is complete.
    """

    limits = Limits()
    """Set per server by `server()` (a subclass per `Limits`)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._head_bytes = 0
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_expired)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_error_response(status, reason, message))
            self.transport.close()

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._in_head:
            self._refuse(
                408,
                "Request Timeout",
                f"request head not received within {self.limits.head_timeout_s:g} s",
            )

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(
                431,
                "Request Header Fields Too Large",
                f"request head exceeds {self.limits.max_head_bytes} bytes",
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


def server(
    app: Callable[..., Awaitable[None]],
    host: str,
    port: int,
    limits: Limits | None = None,
    drain_s: int = 2,
) -> uvicorn.Server:
    """A uvicorn server for the ASGI `app` (no lifespan, no access log, no proxy headers),
    its clients bounded by `limits`; stopping, it waits `drain_s` for the requests in flight."""
    limits = limits or Limits()
    protocol = type("GuardedHttp", (GuardedHttp,), {"limits": limits})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http=protocol,
        limit_concurrency=limits.max_connections,
        interface="asgi3",
        lifespan="off",
        proxy_headers=False,
        server_header=False,
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=drain_s,
    )
    return uvicorn.Server(config)
