"""The router's upstream HTTP client against raw loopback servers that answer byte by byte as
each test scripts: keep-alive reuse, stale sockets, streaming, timeouts, broken answers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import pytest
import trustme

from kvtier.core.errors import ConfigError
from kvtier.net.http_client import ConnectFailed, ConnectRefused, HttpPool
from kvtier.tools.fake_replica import FakeReplica
from tests.helpers.aio import run

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@dataclass
class Peer:
    """The server's side of one connection."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    index: int
    """0 on the server's first connection, 1 on its second..."""
    requests: list[bytes]
    """Every request the server read, on any connection."""

    async def request(self) -> bytes:
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        self.requests.append(head + await self.reader.readexactly(length))
        return self.requests[-1]

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()


Script = Callable[[Peer], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(script: Script) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A loopback server running `script` per connection; yields its URL and the requests."""
    requests: list[bytes] = []
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            await script(Peer(reader, writer, connections - 1, requests))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", requests
    finally:
        server.close()
        await server.wait_closed()


async def answer_ok_forever(peer: Peer) -> None:
    while True:
        await peer.request()
        await peer.send(OK)


def test_a_second_request_reuses_the_connection_and_sends_body_and_headers() -> None:
    connections: list[int] = []

    async def script(peer: Peer) -> None:
        connections.append(peer.index)
        await answer_ok_forever(peer)

    async def scenario() -> None:
        async with raw_server(script) as (url, requests):
            pool = HttpPool(1.0, 5.0)
            for body in (b'{"a": 1}', b'{"b": 2}'):
                resp = await pool.post(
                    url, "/v1/completions", body, [("Content-Type", "application/json")]
                )
                assert resp.status == 200
                assert (b"Content-Type", b"application/json") in resp.headers
                assert await resp.read() == b"{}"
                resp.close()
            pool.close()
        assert connections == [0]
        assert len(requests) == 2
        first = requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:" in first and b"\r\nContent-Length: 8\r\n" in first
        assert b"\r\nContent-Type: application/json\r\n" in first
        assert first.endswith(b'\r\n\r\n{"a": 1}')

    run(scenario())


def test_an_answer_left_half_read_is_aborted_not_reused() -> None:
    connections: list[int] = []

    async def script(peer: Peer) -> None:
        connections.append(peer.index)
        await peer.request()
        if peer.index == 0:
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
            assert await peer.reader.read() == b""  # the client hung up
            return
        await peer.send(OK)

    async def scenario() -> None:
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            (await pool.post(url, "/x", b"{}", [])).close()
            resp = await pool.post(url, "/x", b"{}", [])
            assert await resp.read() == b"{}"
            resp.close()
            pool.close()
        assert connections == [0, 1]

    run(scenario())


def test_interim_answers_are_skipped_and_each_request_gets_its_own_answer() -> None:
    """A 1xx (103 Early Hints) before the answer: the answer is the one after it, and the
    connection carries the next request with its own."""

    async def script(peer: Peer) -> None:
        while True:
            request = await peer.request()
            await peer.send(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
            body = request.rsplit(b"\r\n\r\n", 1)[1]
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    async def scenario() -> None:
        async with raw_server(script) as (url, requests):
            pool = HttpPool(1.0, 5.0)
            for body in (b"first", b"second"):
                resp = await pool.post(url, "/x", body, [])
                assert (resp.status, await resp.read()) == (200, body)
                assert (b"Link", b"</x>") not in resp.headers
                resp.close()
            pool.close()
        assert len(requests) == 2

    run(scenario())


def test_bytes_after_an_answer_are_not_read_into_it_and_the_connection_is_not_reused() -> None:
    connections: list[int] = []

    async def script(peer: Peer) -> None:
        connections.append(peer.index)
        await peer.request()
        # one answer and a second one nobody asked for, in one write
        await peer.send(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
        await answer_ok_forever(peer)

    async def scenario() -> None:
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            for _ in range(2):
                resp = await pool.post(url, "/x", b"{}", [])
                assert (resp.status, await resp.read()) == (200, b"{}")
                resp.close()
            pool.close()
        assert connections == [0, 1]

    run(scenario())


def test_a_complete_answer_closed_unread_is_not_reused() -> None:
    """Past 1 MiB buffered, reading pauses: an answer whose last bytes crossed that mark is
    complete with reading paused; closed unread, its connection must not carry the next."""
    connections: list[int] = []

    async def script(peer: Peer) -> None:
        connections.append(peer.index)
        if peer.index == 0:
            await peer.request()
            size = (1 << 20) + 100
            await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            await peer.send(b"a" * (1 << 20))
            await asyncio.sleep(0.2)
            await peer.send(b"a" * 100)  # crosses 1 MiB and completes the body
        await answer_ok_forever(peer)

    async def scenario() -> None:
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            resp = await pool.post(url, "/x", b"{}", [])
            await asyncio.sleep(0.5)  # a slow client downstream: all of it arrives meanwhile
            assert await resp.chunk()
            resp.close()  # the rest unread
            resp = await pool.post(url, "/x", b"{}", [])
            assert await asyncio.wait_for(resp.read(), 2) == b"{}"
            resp.close()
            pool.close()
        assert connections == [0, 1]

    run(scenario())


def test_read_refuses_an_answer_past_its_limit() -> None:
    async def scenario() -> None:
        async with raw_server(answer_ok_forever) as (url, _):
            pool = HttpPool(1.0, 5.0)
            resp = await pool.post(url, "/x", b"{}", [])
            with pytest.raises(ConnectionError, match="exceeds 1 bytes"):
                await resp.read(1)
            resp.close()
            resp = await pool.post(url, "/x", b"{}", [])
            assert await resp.read(2) == b"{}"
            resp.close()
            pool.close()

    run(scenario())


def test_a_stale_keep_alive_socket_is_retried_on_a_fresh_connection() -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(OK)
        if peer.index == 0:  # the next request on this socket finds it closing, unanswered
            await peer.request()
            peer.writer.transport.abort()
            return
        await answer_ok_forever(peer)

    async def scenario() -> None:
        on_way: list[int] = []
        async with raw_server(script) as (url, requests):
            pool = HttpPool(1.0, 5.0)
            for turn in range(2):
                resp = await pool.post(url, "/x", b"{}", [], partial(on_way.append, turn))
                assert resp.status == 200 and await resp.read() == b"{}"
                resp.close()
            pool.close()
        assert len(requests) == 3  # the second request was sent twice
        assert on_way == [0, 1]  # ...and its bookkeeping ran once

    run(scenario())


def _waiting_bytes(sock: socket.socket) -> bytes:
    """What the kernel holds unread on `sock`, left there."""
    with socket.socket(fileno=os.dup(sock.fileno())) as peer:
        try:
            return peer.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""


def test_on_way_runs_before_anything_else_after_a_kept_alive_write_or_before_a_connect() -> None:
    server_sockets: list[socket.socket] = []

    async def script(peer: Peer) -> None:
        server_sockets.append(peer.writer.get_extra_info("socket"))
        await answer_ok_forever(peer)

    async def scenario() -> None:
        seen: list[tuple[bool, int, bytes]] = []
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            for body in (b'{"a": 1}', b'{"b": 2}'):
                others: list[str] = []
                asyncio.get_running_loop().call_soon(others.append, "ran")

                def on_way(others: list[str] = others) -> None:
                    waiting = _waiting_bytes(server_sockets[0]) if server_sockets else b""
                    seen.append((bool(others), len(server_sockets), waiting))

                resp = await pool.post(url, "/x", body, [], on_way)
                assert await resp.read() == b"{}"
                resp.close()
            pool.close()
        # the first: before its connection existed; the second: written, still unread
        assert seen[0] == (False, 0, b"")
        assert seen[1][:2] == (False, 1) and seen[1][2].endswith(b'\r\n\r\n{"b": 2}')

    run(scenario())


def test_a_chunked_stream_arrives_piece_by_piece() -> None:
    step = asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n8\r\ndata: a\n\r\n"
        )
        await step.wait()
        await peer.send(b"8\r\ndata: b\n\r\n0\r\n\r\n")
        await peer.reader.read()

    async def scenario() -> None:
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            resp = await pool.post(url, "/x", b"{}", [])
            assert await resp.chunk() == b"data: a\n"  # before the rest is even written
            step.set()
            assert await resp.read() == b"data: b\n"
            resp.close()
            pool.close()

    run(scenario())


def test_a_body_ended_by_closing_the_connection_is_read_whole() -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ")
        await peer.send(b"world")

    async def scenario() -> None:
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            resp = await pool.post(url, "/x", b"{}", [])
            assert await resp.read() == b"hello world"
            resp.close()
            pool.close()

    run(scenario())


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", ConnectionResetError),
        (b"garbage\r\n\r\n", ConnectionError),
    ],
)
def test_a_cut_or_garbled_answer_raises_a_connection_error(
    answer: bytes, error: type[Exception]
) -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer)

    async def scenario() -> None:
        async with raw_server(script) as (url, _):
            pool = HttpPool(1.0, 5.0)
            with pytest.raises(error):
                resp = await pool.post(url, "/x", b"{}", [])
                await resp.read()
            pool.close()

    run(scenario())


def test_a_silent_replica_times_out_and_a_closed_port_is_refused() -> None:
    async def silent(peer: Peer) -> None:
        await peer.reader.read()

    async def scenario() -> None:
        async with raw_server(silent) as (url, _):
            pool = HttpPool(1.0, 0.2)
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError) as timed_out:
                await pool.post(url, "/x", b"{}", [])
            assert asyncio.get_running_loop().time() - started < 5
            assert not isinstance(timed_out.value, ConnectFailed)  # it was sent
        with pytest.raises(ConnectRefused) as refused:
            await pool.post(url, "/x", b"{}", [])  # the server is gone now
        assert isinstance(refused.value, ConnectionRefusedError)  # not sent
        with pytest.raises(ConfigError, match=r"http\(s\)://HOST"):
            await pool.post("ftp://127.0.0.1:1", "/x", b"{}", [])

    run(scenario())


def test_https_is_spoken_with_the_pools_trusted_cas_and_a_stranger_is_refused() -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)

    async def scenario() -> None:
        replica = await FakeReplica(tls=server_tls).start()
        try:
            assert replica.url.startswith("https://")
            for _ in range(2):  # a fresh connection, then a reused one
                resp = await HttpPool(2.0, 5.0, tls=trusting).get(replica.url, "/health")
                assert (resp.status, await resp.read()) == (200, b"ok")
                resp.close()
            with pytest.raises(ConnectionError, match="TLS to 127.0.0.1:.* failed.*CERTIFICATE"):
                await HttpPool(2.0, 5.0).get(replica.url, "/health")  # the system's CAs only
        finally:
            await replica.stop()

    run(scenario())
