"""A lean HTTP/1.1 server: the router's face to its clients.

Why not uvicorn (the router's server until 2026-12-06): per request uvicorn builds an ASGI
scope, a response cycle, `receive`/`send` message dicts and, for a handler that must notice a
client hanging up, a task of its own waiting for `http.disconnect` (what that cost the router's
hop: docs/router.md, "HTTP path"). Here a request is an `Exchange`
that writes straight to its connection's transport, the request parsed by `httptools` (llhttp,
as in uvicorn) and a hang-up cancels the handler from `connection_lost`.

What one client may make the server hold is bounded (`Limits`): the request head in size (431)
and in time from the connection's start or a request's first byte (408), the number of
connections (503 beyond), by the handler's `Exchange.body(limit, timeout_s)` the body, and
an answer the client does not read: a write waits at most `head_timeout_s` for the client to
take more, then the connection is dropped as if the client hung up. An idle keep-alive
connection is closed after `keep_alive_s`. Requests on one connection are answered in order (a
pipelined request waits, its connection no longer read, until the one before is answered).
`HttpServer.serve` stops on `stop()` or SIGINT/SIGTERM (main thread only): it stops accepting,
closes idle connections and gives the requests in flight `drain_s` to end.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, TypeVar, cast
from urllib.parse import unquote

import httptools

from kvtier.net.deadline import Deadline

__all__ = [
    "JSON_HEADERS",
    "BodyTimeout",
    "BodyTooLarge",
    "ClientGone",
    "Exchange",
    "Handler",
    "Header",
    "HttpServer",
    "Limits",
    "fast_loop_factory",
]

Header = tuple[bytes, bytes]
T = TypeVar("T")
log = logging.getLogger(__name__)

JSON_HEADERS: list[Header] = [(b"content-type", b"application/json")]

_BODY_PAUSE_BYTES = 1 << 20
"""Body bytes of one request received at which the connection stops being read until its
handler reads the body (then it is read again: a hang-up must reach `connection_lost`)."""
_LINGER_S = 2.0
_LINGER_BYTES = 16 << 20
"""How long, and how many bytes, a connection closed on a client still sending is read and
dropped after its answer (`_Connection.close_unread`)."""
_MAX_HEADERS = 256
"""Header lines a request head may hold (each costs more in memory than on the wire)."""


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


class BodyTimeout(Exception):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request body not received within {timeout_s:g} s")


class ClientGone(Exception):
    """The client hung up before its answer was complete."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may make the server hold (see the module docstring)."""

    max_head_bytes: int = 64 * 1024
    head_timeout_s: float = 30.0
    """For a request head to arrive, and for a client to take more of an answer."""
    max_connections: int | None = None
    keep_alive_s: float = 5.0


def fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory when present (faster), else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def error_response(status: int, message: str) -> bytes:
    """A whole answer with an OpenAI-style error body that closes the connection."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    return (
        _status_line(status) + b"content-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
    )


@functools.cache
def _status_line(status: int) -> bytes:
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b"Status"
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


class _Date:
    """The `date` header, formatted once per second."""

    def __init__(self) -> None:
        self._second = -1
        self._header = b""

    def header(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._header = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._header


_date = _Date()


class Exchange:
    """One request and its answer: headers, the body, a whole or streamed (chunked) answer."""

    __slots__ = (
        "_body",
        "_body_done",
        "_body_size",
        "_body_waiter",
        "_close",
        "_conn",
        "_continue",
        "_guarded",
        "_head_only",
        "_http10",
        "client_gone",
        "done",
        "headers",
        "method",
        "path",
        "started",
        "tenant",
    )

    def __init__(
        self,
        conn: _Connection,
        method: str,
        path: str,
        headers: dict[str, str],
        keep_alive: bool,
        http10: bool = False,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.headers = headers
        """Request headers by lower-case name (a repeated header keeps its last value)."""
        self.started = False
        """True once the status line is sent: errors can no longer be answered."""
        self.done = False
        """True once the answer is complete as the client reads it: its last body byte, or
        the event that ends a stream (`write(..., complete=True)`), handed to the transport."""
        self.client_gone = False
        """True once the client hung up before the answer was complete."""
        self.tenant: str | None = None
        """The tenant of the request's API key (`kvtier.router.auth`); None: shared."""
        self._close = not keep_alive
        self._head_only = method == "HEAD"
        self._http10 = http10
        """An HTTP/1.0 client: a streamed answer is not chunked (1.0 has no chunking) and the
        connection's close ends it."""
        self._continue = headers.get("expect", "").lower() == "100-continue"
        self._body: deque[bytes] = deque()
        self._body_size = 0
        self._body_done = False
        self._body_waiter: asyncio.Future[None] | None = None
        self._guarded: asyncio.Task[Any] | None = None

    # ----- the request body (fed by the connection) -----

    def _feed(self, data: bytes) -> None:
        self._body.append(data)
        self._body_size += len(data)
        self._wake()

    def _end_body(self) -> None:
        self._body_done = True
        self._wake()

    def _wake(self) -> None:
        if self._body_waiter is not None and not self._body_waiter.done():
            self._body_waiter.set_result(None)

    def _hang_up(self) -> None:
        """The connection was lost: wake a body read, cancel the guarded work."""
        if self.done:
            return
        self.client_gone = True
        self._wake()
        if self._guarded is not None:
            self._guarded.cancel()

    async def body(self, limit: int, timeout_s: float | None = None) -> bytes:
        """The whole body; BodyTooLarge beyond `limit` bytes, BodyTimeout when it takes longer
        than `timeout_s` to arrive, ClientGone when the client hangs up first."""
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise BodyTooLarge(limit)
        if not self._body_done:
            if self._continue:
                self._continue = False
                self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                async with asyncio.timeout(timeout_s):
                    await self._await_body(limit)
            except TimeoutError:
                assert timeout_s is not None
                raise BodyTimeout(timeout_s) from None
        if self._body_size > limit:
            raise BodyTooLarge(limit)
        body = b"".join(self._body)
        self._body.clear()
        self._conn.body_read()
        return body

    async def _await_body(self, limit: int) -> None:
        loop = asyncio.get_running_loop()
        while not self._body_done:
            if self.client_gone:
                raise ClientGone
            if self._body_size > limit:
                raise BodyTooLarge(limit)
            self._conn.resume_reading()  # the handler is reading: let the body in
            self._body_waiter = loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None

    # ----- the answer -----

    def _head(self, status: int, headers: Iterable[Header], framing: bytes) -> bytes:
        lines = [_status_line(status)]
        for name, value in headers:
            if name.lower() == b"connection" and value.lower() == b"close":
                self._close = True
                continue
            lines.append(name + b": " + value + b"\r\n")
        lines.append(_date.header())
        lines.append(framing)
        # draining: the last answer; a body not read: the connection cannot carry another
        self._close = self._close or self._conn.server.stopping or not self._body_done
        lines.append(b"connection: close\r\n\r\n" if self._close else b"\r\n")
        return b"".join(lines)

    async def respond(self, status: int, body: bytes, headers: Iterable[Header]) -> None:
        """Answer whole: status, headers (a `connection: close` among them ends the
        connection after it) and body."""
        self.started = True
        head = self._head(status, headers, b"content-length: %d\r\n" % len(body))
        self.done = True
        self._conn.write(head if self._head_only else head + body)
        await self._conn.drained()

    async def respond_json(
        self, status: int, doc: object, *, close: bool = False, headers: Iterable[Header] = ()
    ) -> None:
        """Answer `doc` as JSON, with `headers` besides its content type; `close` ends the
        connection after it (the client may still be sending a request body nobody will
        read)."""
        close_header = [(b"connection", b"close")] if close else []
        await self.respond(
            status, json.dumps(doc).encode(), [*JSON_HEADERS, *headers, *close_header]
        )

    async def start(self, status: int, headers: Iterable[Header]) -> None:
        """Begin a streamed response (chunked transfer encoding; for HTTP/1.0, ended by the
        connection's close)."""
        self.started = True
        if self._http10:
            self._close = True
            self._conn.write(self._head(status, headers, b""))
        else:
            self._conn.write(self._head(status, headers, b"transfer-encoding: chunked\r\n"))

    async def write(self, chunk: bytes, *, complete: bool = False) -> None:
        """Send a body chunk, waiting while the client reads slower than it comes; `complete`:
        the client has its whole answer with it (SSE's `[DONE]`), so a hang-up after it is not
        a lost answer."""
        if chunk and not self._head_only:
            self._conn.write(chunk if self._http10 else b"%x\r\n%b\r\n" % (len(chunk), chunk))
        self.done = self.done or complete
        await self._conn.drained()

    async def finish(self) -> None:
        """End a streamed response."""
        self.done = True
        if not self._head_only and not self._http10:
            self._conn.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """Drop the connection: a streamed body cut short that cannot say so otherwise."""
        self._close = True
        self._conn.abort()

    async def cancel_on_disconnect(self, work: Awaitable[T]) -> T:
        """Await `work` (after the body was read); if the client hangs up before the answer is
        complete, cancel it and raise ClientGone."""
        task = asyncio.current_task()
        assert task is not None
        self._guarded = task
        try:
            return await work
        except asyncio.CancelledError:
            if self.client_gone and task.uncancel() == 0:
                raise ClientGone from None
            raise
        finally:
            self._guarded = None


Handler = Callable[[Exchange], Awaitable[None]]


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs the handler for each in turn."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._deadline = Deadline(self._loop)
        self._in_head = True
        self._head_bytes = 0
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._header_lines = 0
        self._current: Exchange | None = None  # the request whose body is being parsed
        self._parsed_last: Exchange | None = None  # the last request parsed, until another begins
        self._active: Exchange | None = None  # the request being answered
        self._task: asyncio.Task[None] | None = None
        self._queue: deque[Exchange] = deque()
        self._reading_paused = False
        self._writable: asyncio.Future[None] | None = None
        self._write_paused = False
        self._lingering = False
        self._lingered_bytes = 0
        self._close_after_queue = False
        """A request behind those parsed was refused: close once they are answered."""
        self._lost = False
        self.closed = False

    @property
    def idle(self) -> bool:
        return self._active is None and self._in_head and self._head_bytes == 0

    # ----- transport callbacks -----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        self.server.connections.add(self)
        self._time_head()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered_bytes += len(data)
            if self._lingered_bytes > _LINGER_BYTES and self._transport is not None:
                self._transport.close()
            return
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if not self._ignore_upgrade():
                self._refuse(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
            return
        if self._in_head and self._head_bytes > self.server.limits.max_head_bytes:
            self._refuse(431, f"request head exceeds {self.server.limits.max_head_bytes} bytes")

    def _ignore_upgrade(self) -> bool:
        """Answer a request offering HTTP/2 (h2c: `curl --http2` on http://) over HTTP/1.1, as
        a server may (RFC 9110, 7.8): possible for one without a body, which the parser stopped
        after; the connection ends after the answer (its parser cannot go on). Other upgrades
        (WebSocket, CONNECT) are refused."""
        exchange = self._parsed_last
        if (
            exchange is None
            or exchange.headers.get("upgrade", "").strip().lower() != "h2c"
            or not exchange._body_done
            or exchange.headers.get("content-length", "0") != "0"
            or "transfer-encoding" in exchange.headers
        ):
            return False
        exchange._close = True
        self._lingering = True  # nothing more is parsed: what follows is dropped
        return True

    def eof_received(self) -> bool | None:
        return None  # the client is done: close (a hang-up for a request in flight)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost = True
        self._deadline.close()
        self.server.connections.discard(self)
        if self._active is not None:
            self._active._hang_up()
        self._queue.clear()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # ----- httptools callbacks -----

    def on_message_begin(self) -> None:
        self._in_head = True
        self._parsed_last = None
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._header_lines = 0
        if self._active is None:
            self._time_head()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:  # a chunked body's trailer: the request's headers are set
            return
        self._header_bytes += len(name) + len(value) + 4  # (": " and the line's end)
        self._header_lines += 1
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.closed:  # refused or closing: what follows in the same read goes unanswered
            return
        self._in_head = False
        self._head_bytes = 0
        self._deadline.disarm()
        limits = self.server.limits
        if len(self._url) + self._header_bytes > limits.max_head_bytes:
            # a head that came whole in one read (a trickled one is cut in data_received)
            self._refuse(431, f"request head exceeds {limits.max_head_bytes} bytes")
            return
        if self._header_lines > _MAX_HEADERS:
            self._refuse(431, f"request head has more than {_MAX_HEADERS} header lines")
            return
        path = httptools.parse_url(self._url).path.decode("latin-1")
        exchange = Exchange(
            self,
            self._parser.get_method().decode("ascii"),
            unquote(path) if "%" in path else path,
            self._headers,
            self._parser.should_keep_alive(),
            self._parser.get_http_version() == "1.0",
        )
        self._current = self._parsed_last = exchange
        limit = limits.max_connections
        if limit is not None and len(self.server.connections) > limit:
            self._refuse(503, "the router has too many connections; retry later")
            return
        if self._active is None:
            self._begin(exchange)
        else:  # pipelined: answered after the one in flight
            self._queue.append(exchange)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        if self._current is None:
            return
        self._current._feed(body)
        if self._current._body_size > _BODY_PAUSE_BYTES:
            self.pause_reading()

    def on_message_complete(self) -> None:
        self._in_head = True  # what comes next is the next request's head
        if self._current is not None:
            self._current._end_body()
            self._current = None

    # ----- running requests -----

    def _begin(self, exchange: Exchange) -> None:
        self._active = exchange
        self._task = self._loop.create_task(self._run(exchange))

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.server.handler(exchange)
        except (asyncio.CancelledError, ClientGone):
            pass
        except Exception:  # a handler's bug: the client gets a 500, the server goes on
            log.exception("unhandled error answering %s %s", exchange.method, exchange.path)
            if not exchange.started:
                self.write(error_response(500, "internal server error"))
            exchange._close = True
        finally:
            self._active = None
            self._task = None
        if not exchange._body_done:
            self.close_unread()
        elif exchange._close or self.server.stopping:
            self.close()
        elif self._close_after_queue and not self._queue:
            self.close_unread()
        elif self._queue:
            self.resume_reading()
            self._begin(self._queue.popleft())
        elif not self.closed:
            self.resume_reading()
            self._deadline.arm(self.server.limits.keep_alive_s, self.close)

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.closed:
            self._transport.write(data)

    async def drained(self) -> None:
        """Return once the transport takes more (at once unless the client reads slowly). A
        client that takes nothing for `Limits.head_timeout_s` is dropped: the connection is
        aborted and its exchange hangs up (guarded work is cancelled, as for any hang-up)."""
        if not self._write_paused or self.closed:
            return
        try:
            async with asyncio.timeout(self.server.limits.head_timeout_s):
                while self._write_paused and not self.closed:
                    await self._writable_or_lost()
        except TimeoutError:
            self.abort()
            if not self._lost:  # (unless it came in the same turn as the timeout)
                await self._writable_or_lost()  # connection_lost follows the abort

    async def _writable_or_lost(self) -> None:
        """Wait for `resume_writing` or `connection_lost`."""
        self._writable = self._loop.create_future()
        await self._writable

    def body_read(self) -> None:
        """The request in flight has its whole body: read on, so that a hang-up is seen while
        it is answered (unless pipelined requests wait: they keep the connection unread)."""
        if not self._queue:
            self.resume_reading()

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Close once what was written is sent; nothing more is written or read."""
        self._deadline.disarm()
        if self._transport is not None and not self.closed:
            self.closed = True
            self._transport.close()

    def close_unread(self) -> None:
        """Close a connection whose client may still be sending (a request answered before its
        body was read, or refused): the answer goes out and the write side is shut, then what
        arrives is read and dropped until the client closes, for at most `_LINGER_S` and
        `_LINGER_BYTES`. Closed at once on unread bytes, the kernel would reset the connection
        and the client could lose the answer. A request in flight hangs up."""
        if self._transport is None or self.closed:
            return
        self.closed = True  # nothing more is parsed or answered
        self._lingering = True
        if self._active is not None:
            self._active._hang_up()
        self._queue.clear()
        if self._transport.can_write_eof():
            self._transport.write_eof()
        self._deadline.arm(_LINGER_S, self._transport.close)
        self._reading_paused = False
        self._transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection now, unsent bytes too."""
        if self._transport is not None:
            self.closed = True
            self._transport.abort()

    async def finished(self) -> None:
        if self._task is not None:
            await asyncio.wait([self._task])

    # ----- timers and refusals -----

    def _time_head(self) -> None:
        """Bound the time to a complete head, from now (unless already bounded)."""
        if self._deadline.expire != self._head_expired:
            self._deadline.arm(self.server.limits.head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        if self._in_head and self._active is None:
            limit = self.server.limits.head_timeout_s
            self._refuse(408, f"request head not received within {limit:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with an OpenAI error body and close. With a request in flight, only
        when the fault is in that request itself (its body, an upgrade it asks for) and its
        answer has not begun: the error then replaces the handler's answer. A fault in a
        pipelined request behind it is never answered in its place: the requests before the
        fault are answered, then the connection closes."""
        active = self._active
        if active is None or (active is self._parsed_last and not active.started):
            if active is not None:
                active.started = True
            self.write(error_response(status, message))
            self.close_unread()
            return
        # a fault behind the request in flight: nothing more is parsed, the requests before the
        # faulty one are answered, then the connection closes
        faulty = self._parsed_last  # (None for a fault in a head: it made no request)
        if faulty is not None and faulty in self._queue:
            self._queue.remove(faulty)
        self._lingering = True
        self._close_after_queue = True


class HttpServer:
    """Serves `handler` on a listening socket (see the module docstring)."""

    def __init__(self, handler: Handler, limits: Limits | None = None, drain_s: float = 2) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        self.drain_s = drain_s
        self.connections: set[_Connection] = set()
        self.started = False
        self.stopping = False
        self._stop: asyncio.Event | None = None

    def stop(self) -> None:
        """Begin the shutdown (thread-unsafe: call it on the server's loop)."""
        self.stopping = True
        if self._stop is not None:
            self._stop.set()

    async def serve(self, sock: socket.socket) -> None:
        """Serve until `stop()` or a signal, then drain (see the module docstring)."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self.stopping:
            self._stop.set()
        listener = await loop.create_server(lambda: _Connection(self), sock=sock, backlog=2048)
        signals = (signal.SIGINT, signal.SIGTERM)
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            for number in signals:
                loop.add_signal_handler(number, self.stop)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            self.stopping = True
            listener.close()
            if on_main:
                for number in signals:
                    loop.remove_signal_handler(number)
            await self._drain()

    async def _drain(self) -> None:
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
        busy = [asyncio.ensure_future(conn.finished()) for conn in list(self.connections)]
        if busy:
            await asyncio.wait(busy, timeout=self.drain_s)
        for conn in list(self.connections):
            conn.abort()  # their handlers see the hang-up: let them end
        if busy:
            await asyncio.wait(busy, timeout=1.0)
        for waiter in busy:
            waiter.cancel()
