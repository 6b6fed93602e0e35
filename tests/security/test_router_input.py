"""Hostile input to the router: absurd JSON, out-of-range token ids, and clients that trickle,
oversize or abandon their requests (raw sockets, so the bytes on the wire are exactly ours)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvtier.router.tokenizer import Tokenizer
from tests.helpers.aio import run
from tests.helpers.router import MODEL, completion, dumps, fakes, running_router

NESTED = 1000
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
"""A chat template that would keep the router's event loop busy for hours."""


def nested(depth: int) -> object:
    doc: object = "x"
    for _ in range(depth):
        doc = [doc]
    return doc


def error_of(status: int, body: bytes) -> dict[str, object]:
    doc = json.loads(body)
    assert set(doc["error"]) == {"message", "type", "param", "code"}, (status, doc)
    return doc["error"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            b'{"model": "smol", "messages": [' + b"[" * NESTED + b"]" * NESTED + b"]}",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "smol", "messages": [{"role": "user", "content": '
            + b"[" * NESTED
            + b"]" * NESTED
            + b"}]}",
        ),
        ("/v1/completions", b'{"model": "smol", "prompt": ' + b"[" * 50_000),
        ("/v1/completions", b'{"model": "smol", "x": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000),
        ("/v1/completions", dumps({"model": MODEL, "prompt": [2**40, 1]})),
        ("/v1/completions", dumps({"model": MODEL, "prompt": [[1, 2], [2**33]]})),
        (
            "/v1/chat/completions",
            dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "chat_template_kwargs": {"chat_template": LOOPS},
                }
            ),
        ),
    ],
    ids=[
        "nested-messages",
        "nested-content",
        "unclosed",
        "nested-objects",
        "huge-id",
        "huge-id-2",
        "own-template",
    ],
)
def test_absurd_bodies_are_a_400_and_reach_no_replica(
    path: str, body: bytes, tokenizer: Tokenizer
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            resp = await rr.client.post(
                rr.url + path, content=body, headers={"Content-Type": "application/json"}
            )
            assert resp.status_code == 400, resp.text
            error_of(400, resp.content)
            assert a.received == []
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 200

    run(scenario())


def test_nesting_inside_strings_is_not_counted(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            prompt = "[" * 300 + '\\"{' * 100
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion(prompt))
            assert resp.status_code == 200
            assert a.received[0]["prompt"] == prompt

    run(scenario())


# ----- raw sockets -----


async def exchange(
    port: int, chunks: list[bytes], pause_s: float = 0.0, wait_s: float = 10.0
) -> tuple[bytes, float]:
    """Send `chunks` (pausing between them), then read until the router closes; returns what
    it answered and the seconds from connecting to the close. Stops sending once the router
    has closed the connection."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()

    async def read_all() -> None:
        while chunk := await reader.read(65536):
            received.extend(chunk)

    reading = asyncio.create_task(read_all())
    try:
        for chunk in chunks:
            if reading.done():
                break
            writer.write(chunk)
            try:
                await writer.drain()
            except ConnectionError:
                break
            if pause_s:
                await asyncio.sleep(pause_s)
        await asyncio.wait_for(reading, wait_s)
    finally:
        writer.close()
    return bytes(received), time.monotonic() - started


def status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


LIMITS = {"client_timeout_s": 0.5, "max_header_bytes": 4096}
REQUEST_LINE = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def test_a_client_that_never_speaks_is_answered_408_and_dropped(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], **LIMITS) as rr:
            answer, took = await exchange(port_of(rr.url), [])
            status, body = status_and_body(answer)
            assert status == 408 and error_of(status, body)
            assert 0.4 < took < 3.0

    run(scenario())


def test_headers_trickled_byte_by_byte_are_cut_off_in_time(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], **LIMITS) as rr:
            head = REQUEST_LINE + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
            answer, took = await exchange(port_of(rr.url), [bytes([c]) for c in head], 0.02)
            status, _ = status_and_body(answer)
            assert status == 408
            assert took < 3.0  # not the 4+ s the trickle would take
            assert a.received == []

    run(scenario())


@pytest.mark.parametrize("terminated", [True, False], ids=["big-headers", "endless-header"])
def test_oversized_heads_are_a_431(terminated: bool, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], **LIMITS) as rr:
            headers = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"b" * 100) for i in range(100))
            head = REQUEST_LINE + (headers + b"\r\n" if terminated else b"X-Long: " + b"c" * 20000)
            chunks = [head[i : i + 1024] for i in range(0, len(head), 1024)]
            answer, _ = await exchange(port_of(rr.url), chunks)
            status, body = status_and_body(answer)
            assert status == 431 and error_of(status, body)
            assert a.received == []

    run(scenario())


def test_a_body_that_never_completes_is_a_408_and_the_connection_closes(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], **LIMITS) as rr:
            body = dumps(completion())
            head = REQUEST_LINE + b"Content-Length: %d\r\n\r\n" % (len(body) + 100)
            answer, took = await exchange(port_of(rr.url), [head, body])
            status, payload = status_and_body(answer)
            assert status == 408 and "body" in str(error_of(status, payload)["message"])
            assert took < 3.0 and a.received == []

    run(scenario())


def test_connections_beyond_the_limit_get_a_503_and_the_router_recovers(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with (
            fakes("ok") as (a,),
            running_router(tokenizer, [a], max_connections=4, client_timeout_s=5) as rr,
        ):
            idle = [await asyncio.open_connection("127.0.0.1", port_of(rr.url)) for _ in range(4)]
            await asyncio.sleep(0.1)
            body = dumps(completion())
            request = REQUEST_LINE + b"Content-Length: %d\r\n\r\n" % len(body) + body
            answer, _ = await exchange(port_of(rr.url), [request], wait_s=5)
            assert status_and_body(answer)[0] == 503
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.2)
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 200

    run(scenario())


def test_a_keep_alive_connection_serves_several_requests_within_the_limits(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], **LIMITS) as rr:
            for _ in range(3):  # one client, one connection, requests spaced past the timeout
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200
                await asyncio.sleep(0.3)
            assert len(a.received) == 3

    run(scenario())
