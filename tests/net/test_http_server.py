"""The router's HTTP server on raw sockets: framing, keep-alive, pipelining, 100-continue,
flow control, hang-ups, a handler's crash and the drain on stop. (Its limits on what a client
may make it hold are tested through the router in tests/security/test_router_input.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable

import pytest

from kvtier.net.http_server import JSON_HEADERS, ClientGone, Exchange, HttpServer, Limits
from tests.helpers.aio import run


class Handler:
    """Answers by path: /echo the body, /headers the request's headers as JSON, /stream N
    chunks, /flood endless chunks until the client is gone, /slow after a release (/slow-read:
    after reading the body), /crash."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.streamed = asyncio.Event()
        self.seen: list[str] = []

    async def __call__(self, exchange: Exchange) -> None:
        self.seen.append(exchange.path)
        if exchange.path == "/echo":
            await exchange.respond(200, await exchange.body(1 << 20, 5.0), JSON_HEADERS)
        elif exchange.path == "/headers":
            await exchange.body(1 << 20, 5.0)
            await exchange.respond(200, json.dumps(exchange.headers).encode(), JSON_HEADERS)
        elif exchange.path == "/stream":
            await exchange.start(200, [(b"content-type", b"text/plain")])
            for i in range(int(exchange.headers.get("x-chunks", "3"))):
                await exchange.write(b"%d" % i * 65536)
            await exchange.finish()
            self.streamed.set()
        elif exchange.path in ("/slow", "/slow-read"):
            if exchange.path == "/slow-read":
                await exchange.body(8 << 20, 5.0)
            await self._guarded(exchange, self.release.wait())
            await exchange.respond(200, b"late", [])
        elif exchange.path == "/flood":
            await exchange.start(200, [(b"content-type", b"text/plain")])
            await self._guarded(exchange, self._flood(exchange))
        elif exchange.path == "/crash":
            raise RuntimeError("a handler bug")
        else:
            await exchange.respond(404, b"", [])

    async def _guarded(self, exchange: Exchange, work: Awaitable[object]) -> None:
        """Await `work`, cancelled (and noted) when the client is gone."""
        try:
            await exchange.cancel_on_disconnect(work)
        except ClientGone:
            self.cancelled.set()
            raise

    @staticmethod
    async def _flood(exchange: Exchange) -> None:
        while True:
            await exchange.write(b"x" * 65536)


@contextlib.asynccontextmanager
async def serving(
    limits: Limits | None = None, drain_s: float = 2
) -> AsyncIterator[tuple[HttpServer, Handler, int]]:
    handler = Handler()
    server = HttpServer(handler, limits, drain_s)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sock))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server, handler, port
    finally:
        server.stop()
        await task
        sock.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One answer: status line, headers, body (by content-length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head[:-4].split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines)
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    body = bytearray()
    while size := int((await reader.readline()).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return status, headers, bytes(body)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n"
        % (
            path.encode(),
            len(body),
            extra,
        )
        + body
    )


def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async def scenario() -> None:
        async with serving() as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/echo", b"first") + post("/nowhere", b"") + post("/echo", b"3rd"))
            answers = [await read_answer(reader) for _ in range(3)]
            assert [(a[0], a[2]) for a in answers] == [
                (b"HTTP/1.1 200 OK", b"first"),
                (b"HTTP/1.1 404 Not Found", b""),
                (b"HTTP/1.1 200 OK", b"3rd"),
            ]
            assert handler.seen == ["/echo", "/nowhere", "/echo"]
            assert b"date" in answers[0][1] and b"connection" not in answers[0][1]
            writer.close()

    run(scenario())


def test_a_chunked_body_s_trailer_does_not_become_a_request_header() -> None:
    async def scenario() -> None:
        async with serving() as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /headers HTTP/1.1\r\nHost: x\r\nX-Sent: head\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"
                b"X-Sent: trailer\r\nAuthorization: Bearer smuggled\r\n\r\n"
            )
            status, _, body = await read_answer(reader)
            headers = json.loads(body)
            assert status == b"HTTP/1.1 200 OK" and headers["x-sent"] == "head"
            assert "authorization" not in headers
            writer.close()

    run(scenario())


def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async def scenario() -> None:
        async with serving() as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = post("/echo", b"payload", b"Expect: 100-continue\r\n")
            writer.write(request[: -len(b"payload")])  # the head only
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"payload")
            assert (await read_answer(reader))[2] == b"payload"
            writer.close()

    run(scenario())


def test_a_head_request_gets_headers_without_the_body() -> None:
    async def scenario() -> None:
        async with serving() as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n" + post("/echo", b"next"))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
            # no chunks follow: the next bytes are the next answer
            assert (await read_answer(reader))[2] == b"next"
            writer.close()

    run(scenario())


def test_http_1_0_and_connection_close_end_the_connection_after_the_answer() -> None:
    async def scenario() -> None:
        async with serving() as (_, _, port):
            for request in (
                b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi",
                post("/echo", b"hi", b"Connection: close\r\n"),
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                _, headers, body = await read_answer(reader)
                assert body == b"hi" and headers[b"connection"] == b"close"
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
                writer.close()

    run(scenario())


def test_a_stream_to_an_http_1_0_client_is_not_chunked_and_ends_at_the_close() -> None:
    """HTTP/1.0 has no chunked encoding: the body is sent as it comes, the close ends it."""

    async def scenario() -> None:
        async with serving() as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /stream HTTP/1.0\r\nX-Chunks: 2\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head
            assert b"connection: close" in head and body == b"0" * 65536 + b"1" * 65536
            writer.close()

    run(scenario())


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout() -> None:
    async def scenario() -> None:
        async with serving(Limits(keep_alive_s=0.3)) as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/echo", b"x"))
            await read_answer(reader)
            closed_at = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert asyncio.get_running_loop().time() - closed_at >= 0.2
            writer.close()

    run(scenario())


def test_a_stream_to_a_client_that_does_not_read_waits_and_then_arrives_whole() -> None:
    async def scenario() -> None:
        async with serving() as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            chunks = 400  # 50 MB: far beyond the sockets' buffers
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nX-Chunks: %d\r\n\r\n" % chunks)
            await asyncio.sleep(0.5)  # not reading: the handler must wait, not buffer it all
            assert not handler.streamed.is_set()
            _, _, body = await read_answer(reader)
            assert body == b"".join(b"%d" % i * 65536 for i in range(chunks))
            assert handler.streamed.is_set()
            writer.close()

    run(scenario())


def test_a_client_that_stops_reading_a_stream_is_dropped_after_the_timeout() -> None:
    """It would otherwise hold its connection, and the work feeding its answer, forever."""

    async def scenario() -> None:
        async with serving(Limits(head_timeout_s=0.5)) as (server, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(handler.cancelled.wait(), 10)  # cancelled as a hang-up
            await asyncio.sleep(0.05)
            assert not server.connections
            writer.close()

    run(scenario())


def test_a_client_hanging_up_cancels_the_guarded_work() -> None:
    async def scenario() -> None:
        async with serving() as (server, handler, port):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
            await asyncio.wait_for(handler.cancelled.wait(), 5)
            await asyncio.sleep(0.05)
            assert not server.connections

    run(scenario())


def test_a_client_hanging_up_after_a_large_body_cancels_the_guarded_work() -> None:
    """A body past the size at which reading pauses (until the handler reads it): once read,
    the connection is read again, so the hang-up is seen while the work runs."""

    async def scenario() -> None:
        async with serving() as (server, handler, port):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/slow-read", b"x" * (2 << 20)))
            await writer.drain()
            await asyncio.sleep(0.2)  # the body is read, the handler waits
            writer.close()
            await asyncio.wait_for(handler.cancelled.wait(), 5)
            await asyncio.sleep(0.05)
            assert not server.connections

    run(scenario())


def test_a_handler_crash_is_a_500_and_the_server_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with serving() as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /crash HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await read_answer(reader)
            assert status.startswith(b"HTTP/1.1 500") and b"error" in body
            assert headers[b"connection"] == b"close"
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/echo", b"still here"))
            assert (await read_answer(reader))[2] == b"still here"
            writer.close()

    run(scenario())
    assert "a handler bug" in caplog.text


def test_a_malformed_request_is_a_400_and_closes() -> None:
    async def scenario() -> None:
        async with serving() as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 400") and b"malformed" in answer
            assert handler.seen == []
            writer.close()

    run(scenario())


@pytest.mark.parametrize(
    "request_",
    [
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}",
        b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    ],
    ids=["bad-chunk-size", "not-chunked", "upgrade"],
)
def test_a_framing_error_after_the_head_is_a_400_and_closes(request_: bytes) -> None:
    """Found once the request's handler runs, before its answer began: still answered."""

    async def scenario() -> None:
        async with serving() as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_)
            answer = await asyncio.wait_for(reader.read(), 5)  # read to the close
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
            writer.close()

    run(scenario())


def test_a_request_offering_an_upgrade_without_a_body_is_answered_over_http_1_1() -> None:
    """`curl --http2 http://...` offers h2c: the offer is ignored and the connection ends after
    the answer; one with a body (which the parser drops) is still refused."""

    async def scenario() -> None:
        async with serving() as (_, _, port):
            h2c = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AA\r\n"
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /headers HTTP/1.1\r\nHost: x\r\n%s\r\n" % h2c)
            status, headers, body = await asyncio.wait_for(read_answer(reader), 5)
            assert status == b"HTTP/1.1 200 OK" and headers[b"connection"] == b"close"
            assert json.loads(body)["upgrade"] == "h2c"
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/echo", b"hi", h2c))
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 400")
            writer.close()

    run(scenario())


def test_stopping_drains_the_request_in_flight_and_refuses_new_connections() -> None:
    async def scenario() -> None:
        handler = Handler()
        server = HttpServer(handler, drain_s=5)
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        task = asyncio.create_task(server.serve(sock))
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(post("/echo", b"served"))  # then idle on its keep-alive
        assert (await read_answer(idle_reader))[2] == b"served"
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        server.stop()
        assert await asyncio.wait_for(idle_reader.read(), 0.5) == b""  # idle: closed at once
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        assert not task.done()  # draining
        handler.release.set()
        status, headers, body = await read_answer(reader)
        assert (status, body, headers[b"connection"]) == (b"HTTP/1.1 200 OK", b"late", b"close")
        await asyncio.wait_for(task, 5)
        writer.close()
        idle_writer.close()
        sock.close()

    run(scenario())


def test_the_drain_deadline_cuts_requests_that_do_not_finish() -> None:
    async def scenario() -> None:
        async with serving(drain_s=0.2) as (server, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.1)
            server.stop()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # cut, never answered
            writer.close()
        assert handler.cancelled.is_set()

    run(scenario())


def test_a_long_url_counts_against_the_head_limit() -> None:
    async def scenario() -> None:
        async with serving(Limits(max_head_bytes=4096)) as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n" % (b"a" * 6000))  # one read
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 431") and handler.seen == []
            writer.close()

    run(scenario())


def test_a_framing_error_in_a_pipelined_request_is_not_answered_in_place_of_the_one_before() -> (
    None
):
    """The request in flight never gets the 400 of a malformed request pipelined behind it: it
    is answered (it is not cancelled), then the connection closes."""

    async def scenario() -> None:
        async with serving() as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
            )
            await asyncio.sleep(0.2)  # the malformed request is parsed while /slow waits
            assert not handler.cancelled.is_set()
            handler.release.set()
            answer = await asyncio.wait_for(reader.read(), 5)  # read to the close
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"late")
            assert b"400" not in answer
            writer.close()

    run(scenario())


def test_an_answer_given_before_a_large_body_is_read_reaches_the_client() -> None:
    """The handler answers (404) without reading an 8 MiB body: the client, still sending,
    reads the whole answer, told the connection closes, instead of a reset that destroys it
    (the router refuses so: a bad key, an unknown path, a body over the limit)."""

    async def scenario() -> None:
        async with serving() as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            size = 8 << 20
            writer.write(b"POST /nothing HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)

            async def send_body() -> None:
                with contextlib.suppress(ConnectionError):
                    for _ in range(size // 65536):
                        writer.write(b"x" * 65536)
                        await writer.drain()

            sending = asyncio.create_task(send_body())
            status, headers, _ = await asyncio.wait_for(read_answer(reader), 5)
            assert status == b"HTTP/1.1 404 Not Found" and headers[b"connection"] == b"close"
            assert await asyncio.wait_for(reader.read(), 5) == b""  # then the server's end
            assert handler.seen == ["/nothing"]
            sending.cancel()
            writer.close()

    run(scenario())


def test_a_head_of_too_many_header_lines_is_a_431() -> None:
    async def scenario() -> None:
        async with serving() as (_, handler, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            lines = b"".join(b"x%d: y\r\n" % i for i in range(300))  # 3 KiB: under the size
            writer.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n%s\r\n" % lines)
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 431") and handler.seen == []
            writer.close()

    run(scenario())
