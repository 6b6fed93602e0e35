"""The router's HTTP server against mutated bytes on the wire (hypothesis): pipelined requests,
flipped, inserted and dropped bytes, cut into random pieces. Whatever arrives, the server
answers with well-formed HTTP/1.1 responses of expected statuses or closes, in bounded time,
and goes on serving without holding connections."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httptools
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.net.http_server import (
    JSON_HEADERS,
    BodyTimeout,
    BodyTooLarge,
    Exchange,
    HttpServer,
    Limits,
)
from tests.fuzz.budget import cases, fuzz_settings

EXAMPLES = cases(150, 5_000)
EXPECTED = {200, 400, 404, 408, 413, 431}
"""The handler's statuses (200, 404; 413 and 408 for a body too large or too slow) and the
server's refusals (400 malformed, 408 head too slow, 431 head too large)."""
LIMITS = Limits(max_head_bytes=2048, head_timeout_s=0.2, keep_alive_s=0.2)
SENT = [0]
STATUSES: dict[int, int] = {}


async def handler(exchange: Exchange) -> None:
    if exchange.path == "/echo":
        try:
            body = await exchange.body(4096, 0.2)
        except BodyTooLarge:
            await exchange.respond_json(413, {"error": "large"}, close=True)
            return
        except BodyTimeout:
            await exchange.respond_json(408, {"error": "slow"}, close=True)
            return
        await exchange.respond(200, body, JSON_HEADERS)
    elif exchange.path == "/stream":
        await exchange.start(200, [(b"content-type", b"text/plain")])
        for piece in (b"a" * 100, b"b" * 5000):
            await exchange.write(piece)
        await exchange.finish()
    else:
        await exchange.respond(404, b"", [])


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[HttpServer, int]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http = HttpServer(handler, LIMITS, drain_s=1)
    sock = socket.create_server(("127.0.0.1", 0))
    serving = asyncio.run_coroutine_threadsafe(http.serve(sock), loop)
    while not http.started:
        time.sleep(0.01)
    try:
        yield http, sock.getsockname()[1]
    finally:
        loop.call_soon_threadsafe(http.stop)
        serving.result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        sock.close()


def request(method: str, path: str, body: bytes, chunked: bool, close: bool) -> bytes:
    head = b"%s %s HTTP/1.1\r\nHost: x\r\n" % (method.encode(), path.encode())
    if close:
        head += b"Connection: close\r\n"
    if chunked:
        framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + framed
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


requests = st.lists(
    st.builds(
        request,
        st.sampled_from(["GET", "POST", "PUT"]),  # (HEAD: no body to parse)
        st.sampled_from(["/echo", "/stream", "/nowhere", "/e%63ho"]),
        st.binary(max_size=300),
        st.booleans(),
        st.booleans(),
    ),
    min_size=1,
    max_size=3,
).map(b"".join)

mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "drop"]),
        st.integers(0, 10**6),
        st.binary(min_size=1, max_size=8),
    ),
    max_size=4,
)


def mutate(data: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, at, value in edits:
        at %= len(out) + 1
        if kind == "flip" and at < len(out):
            out[at] ^= value[0] or 1
        elif kind == "insert":
            out[at:at] = value
        elif kind == "drop":
            del out[at : at + len(value)]
    return bytes(out)


class Answers:
    """Parses what the server sent as a sequence of responses (one parser: keep-alive);
    collects their statuses."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self._parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.statuses.append(self._parser.get_status_code())

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)


def converse(port: int, data: bytes, cuts: list[int]) -> tuple[bytes, float]:
    """Send `data` in pieces cut at `cuts`, then read until the server closes; returns what
    it sent and the seconds from the last byte sent to the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        edges = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
        try:
            for start, end in zip(edges, edges[1:], strict=False):
                conn.sendall(data[start:end])
        except OSError:  # the server refused and closed while we were sending
            pass
        sent_at = time.monotonic()
        received = bytearray()
        while True:
            try:
                piece = conn.recv(65536)
            except ConnectionResetError:
                break
            if not piece:
                break
            received += piece
        return bytes(received), time.monotonic() - sent_at


@fuzz_settings(EXAMPLES)
@given(data=requests, edits=mutations, cuts=st.lists(st.integers(0, 10**6), max_size=5))
def test_mutated_requests_get_well_formed_answers_or_a_close_in_bounded_time(
    server: tuple[HttpServer, int],
    data: bytes,
    edits: list[tuple[str, int, bytes]],
    cuts: list[int],
) -> None:
    _, port = server
    received, took = converse(port, mutate(data, edits), cuts)
    SENT[0] += 1
    answers = Answers()
    answers.feed(received)  # raises on anything but well-formed HTTP/1.1 responses
    assert set(answers.statuses) <= EXPECTED, (answers.statuses, received[:300])
    for status in answers.statuses:
        STATUSES[status] = STATUSES.get(status, 0) + 1
    assert took < 3.0  # head, body and keep-alive limits all bounded by 0.2 s


def test_the_server_goes_on_serving_and_holds_no_connection_after_the_fuzz(
    server: tuple[HttpServer, int],
) -> None:
    http, port = server
    assert SENT[0] >= EXAMPLES
    print("statuses:", dict(sorted(STATUSES.items())))
    received, _ = converse(port, request("POST", "/echo", b"still here", False, True), [])
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"still here")
    deadline = time.monotonic() + 2
    while http.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not http.connections
