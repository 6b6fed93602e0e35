"""A lean HTTP/1.1 keep-alive client: the router's one client for its replicas (forwarding,
health checks, model lists), and the benchmarks' load client.

Why not aiohttp's client: per request it builds a request object, a timer context, a tracing
and cookie pass and a response wrapper, work comparable to all the rest of the router's hop
(docs/router.md). This client writes head and body in one call and parses the answer
with `httptools` (llhttp, the parser in uvicorn), so a forward costs little more than the
socket work.

One `ReplicaConnection` carries one request at a time; `HttpPool` keeps idle ones per base URL
(LIFO, dropped after `idle_s`, below uvicorn's 5 s keep-alive so a replica rarely closes one
under us). A request on a reused connection that dies before any response byte is retried once
on a fresh connection: that is a stale keep-alive socket, not a dead replica. If that
connection cannot be opened, the replica may have died of the request: the error is then a
`ConnectionResetError`, not a `ConnectFailed` (the request may have been delivered). `https://` base
URLs are spoken over TLS, verified against the pool's `ssl.SSLContext` (the system's CAs by
default); the certificate must name the URL's host.

Failures surface as `OSError`s: `ConnectionError` (refused, reset, closed early, garbled answer)
or `TimeoutError` (connect, or no byte for `read_timeout_s` while an answer is due). Those of
opening a connection are also `ConnectFailed` (`ConnectRefused`, `ConnectTimeout`): the request
was not sent, so the server did none of its work; any other came after it was sent.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

from kvtier.core.errors import ConfigError
from kvtier.net.deadline import Deadline

__all__ = [
    "CONTROL_ANSWER_BYTES",
    "ConnectFailed",
    "ConnectRefused",
    "ConnectTimeout",
    "HttpPool",
    "Response",
]

_PAUSE_BYTES = 1 << 20
"""Buffered response bytes at which the socket stops being read (a slow client downstream)."""
CONTROL_ANSWER_BYTES = 16 << 20
"""The most a replica's answer to a control request (/health, /metrics, /v1/models, a probe)
may hold: a replica cannot make the router buffer more."""


class ConnectFailed(OSError):
    """No connection could be opened (refused, timed out, no route, a failed TLS handshake):
    the request was not sent."""


class ConnectRefused(ConnectFailed, ConnectionRefusedError):
    """Refused (no process listens), or a TLS handshake that failed."""


class ConnectTimeout(ConnectFailed, TimeoutError):
    """No answer to the connection within `connect_timeout_s`."""


class ReplicaConnection(asyncio.Protocol):
    """One keep-alive connection; parses the current response into status, headers, chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float | None) -> None:
        self._loop = loop
        self._read_timeout_s = read_timeout_s
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._deadline = Deadline(loop)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: deque[bytes] = deque()
        self._buffered = 0
        self.got_bytes = False
        self.headers_done = False
        self._interim = False
        self.keep_alive = False
        self.complete = False
        self.error: OSError | None = None

    # ----- asyncio.Protocol -----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._deadline.armed:
            self._arm_timer()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionError("the replica answered with a protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"unparsable answer from the replica: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._deadline.close()
        if self.headers_done and not self.complete and self._ends_at_eof():
            self.on_message_complete()  # a body delimited by the connection's close
        elif not self.complete and self.error is None:
            self.error = ConnectionResetError(
                f"the replica closed the connection{f': {exc}' if exc else ''}"
            )
        self._wake()

    # ----- httptools callbacks -----

    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the answer: not this request's, and never reused
            raise ConnectionError("the replica sent more than one answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (103 Early Hints...): the final one follows
            self.headers = []
            self._interim = True
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_BYTES and not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._deadline.disarm()
        self._wake()

    # ----- used by Response and HttpPool -----

    def send(self, head: bytes, body: bytes) -> None:
        self._reset()
        assert self._transport is not None
        self._transport.writelines((head, body))
        if self._read_timeout_s is not None:
            self._arm_timer()

    async def wait(self) -> None:
        """Until something changes (headers, a chunk, the end, an error)."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        chunk = self.chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= _PAUSE_BYTES // 2 and self._transport is not None:
            self._transport.resume_reading()
            self._paused = False
        return chunk

    def reusable(self) -> bool:
        """Whether the answer was read to its end and the connection may carry another."""
        return (
            self.complete
            and not self.chunks  # (unread bytes may also have paused reading)
            and self.keep_alive
            and not self.closed
            and self.error is None
        )

    def abort(self) -> None:
        self.closed = True
        self._deadline.close()
        if self._transport is not None:
            self._transport.abort()

    def _ends_at_eof(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: OSError) -> None:
        self.error = error
        self.abort()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _arm_timer(self) -> None:
        assert self._read_timeout_s is not None
        self._deadline.arm(self._read_timeout_s, self._timed_out)

    def _timed_out(self) -> None:
        self._fail(TimeoutError(f"no byte from the replica in {self._read_timeout_s:g} s"))


class Response:
    """A replica's answer: `status` and `headers` now, the body as it arrives.

    Call `close()` when done (a finally block): a fully read body returns the connection to
    the pool, anything else aborts it, which tells vLLM to abort the request."""

    __slots__ = ("_conn", "_key", "_pool", "headers", "status")

    def __init__(self, conn: ReplicaConnection, pool: HttpPool, key: str) -> None:
        self._conn = conn
        self._pool = pool
        self._key = key
        self.status = conn.status
        self.headers = conn.headers

    async def chunk(self) -> bytes:
        """The next body bytes, or b"" at the end."""
        conn = self._conn
        while True:
            if conn.chunks:
                return conn.take()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; a `ConnectionError` past `limit` bytes (the connection is then
        aborted by `close`)."""
        parts = []
        size = 0
        while chunk := await self.chunk():
            size += len(chunk)
            if limit is not None and size > limit:
                raise ConnectionError(f"the replica's answer exceeds {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        self._pool.release(self._key, self._conn)


class HttpPool:
    """Keep-alive connections per base URL (`http://host:port` or `https://host:port`)."""

    def __init__(
        self,
        connect_timeout_s: float | None,
        read_timeout_s: float | None,
        idle_s: float = 4.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls` verifies https:// servers (default: the system's trusted CAs)."""
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._idle_s = idle_s
        self._tls = tls
        self._idle: dict[str, list[ReplicaConnection]] = {}
        self._addresses: dict[str, _Address] = {}

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]],
        on_way: Callable[[], object] | None = None,
    ) -> Response:
        """POST `body`; returns once the status line and headers are in (`on_way`: `request`)."""
        return await self.request("POST", base_url, path, body, headers, on_way)

    async def get(
        self, base_url: str, path: str, headers: Iterable[tuple[str, str]] = ()
    ) -> Response:
        """GET `path`; returns once the status line and headers are in."""
        return await self.request("GET", base_url, path, b"", headers)

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[str, str]],
        on_way: Callable[[], object] | None = None,
    ) -> Response:
        """Send one request; returns once the status line and headers are in. Raises
        `ConfigError` for a URL it cannot speak to, `OSError`s for the rest.

        `on_way` runs once, before this first waits: right after the request is written to a
        kept-alive connection, or else before a new connection is opened. The caller's
        bookkeeping there overlaps the replica's work, and no other task runs before it."""
        address = self._address(base_url)
        fields = "".join(f"{name}: {value}\r\n" for name, value in headers)
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Content-Length: {len(body)}\r\n{fields}\r\n"
        ).encode("latin-1")
        conn = self._take_idle(base_url)
        if conn is None:
            if on_way is not None:
                on_way()
            conn = await self._connect(address)
            return await self._exchange(base_url, conn, head, body, None)
        try:
            return await self._exchange(base_url, conn, head, body, on_way)
        except ConnectionError as exc:
            if conn.got_bytes:
                raise
            closed = exc
        # a stale keep-alive socket (the replica closed it while idle): retry once
        # (`on_way` has run: a write never raises, its failure comes as `conn.error`)
        try:
            conn = await self._connect(address)
        except ConnectFailed as exc:  # a replica that died of the request, maybe: it got it
            raise ConnectionResetError(f"{closed}, and then refused a new one: {exc}") from exc
        return await self._exchange(base_url, conn, head, body, None)

    async def _exchange(
        self,
        key: str,
        conn: ReplicaConnection,
        head: bytes,
        body: bytes,
        on_way: Callable[[], object] | None,
    ) -> Response:
        try:
            conn.send(head, body)
            if on_way is not None:
                on_way()
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.abort()
            raise
        return Response(conn, self, key)

    async def host_answers(self, base_url: str, timeout_s: float) -> bool:
        """Whether the host of `base_url` answers a new TCP connection within `timeout_s`:
        accepted or refused (no TLS, no request: a process that hangs still has a kernel that
        accepts), not a timeout or no route (a host that is gone or cut off)."""
        address = self._address(base_url)
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(address.host, address.port)
        except ConnectionRefusedError:
            return True
        except (TimeoutError, OSError):
            return False
        writer.close()
        return True

    def release(self, key: str, conn: ReplicaConnection) -> None:
        if conn.reusable():
            conn.idle_since = time.monotonic()
            self._idle.setdefault(key, []).append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()

    def _take_idle(self, key: str) -> ReplicaConnection | None:
        conns = self._idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if not conn.closed and now - conn.idle_since < self._idle_s:
                return conn
            conn.abort()
        return None

    async def _connect(self, address: _Address) -> ReplicaConnection:
        loop = asyncio.get_running_loop()
        tls = None
        if address.tls:
            tls = self._tls if self._tls is not None else ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: ReplicaConnection(loop, self._read_timeout_s),
                    address.host,
                    address.port,
                    ssl=tls,
                    server_hostname=address.host if tls else None,
                )
        except ssl.SSLError as exc:  # a certificate or handshake failure: cannot connect
            raise ConnectRefused(f"TLS to {address.netloc} failed: {exc}") from exc
        except ConnectionRefusedError as exc:
            raise ConnectRefused(f"{address.netloc} refused the connection: {exc}") from exc
        except TimeoutError as exc:
            raise ConnectTimeout(f"no connection to {address.netloc}: timed out") from exc
        except OSError as exc:  # no route, an unknown host...
            raise ConnectFailed(f"no connection to {address.netloc}: {exc}") from exc
        return conn

    def _address(self, base_url: str) -> _Address:
        address = self._addresses.get(base_url)
        if address is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"url: expected http(s)://HOST[:PORT], got {base_url!r}")
            tls = parts.scheme == "https"
            address = _Address(
                parts.hostname, parts.port or (443 if tls else 80), parts.netloc, tls
            )
            self._addresses[base_url] = address
        return address


@dataclass(frozen=True, slots=True)
class _Address:
    host: str
    port: int
    netloc: str
    tls: bool
