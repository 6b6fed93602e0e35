"""An OpenAI-API load client that measures what the benchmarks report.

One streamed request per call, over kvtier's own HTTP client (`kvtier.net.http_client`); TTFT is
the time from sending the request to the first streamed token. The final usage chunk
(`stream_options.include_usage`) gives prompt tokens and, when the server runs with
`--enable-prompt-tokens-details`, the tokens it served from any cache tier
(`prompt_tokens_details.cached_tokens`). `call` is the one-off request of synchronous tools.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.core.errors import KvtierError
from kvtier.net.http_client import HttpPool, Response

__all__ = ["Outcome", "cached_tokens", "call", "new_pool", "post_json", "stream_request"]

JSON = [("Content-Type", "application/json")]


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    text: str


def new_pool(timeout_s: float = 600.0) -> HttpPool:
    """A keep-alive pool for a benchmark's requests (connect 10 s, `timeout_s` of silence)."""
    return HttpPool(10.0, timeout_s)


async def post_json(pool: HttpPool, url: str, path: str, body: object) -> Response:
    return await pool.post(url, path, json.dumps(body).encode(), JSON)


async def _lines(resp: Response) -> AsyncIterator[bytes]:
    """The body's lines as they arrive."""
    pending = b""
    while chunk := await resp.chunk():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line
    if pending:
        yield pending


async def stream_request(
    pool: HttpPool, url: str, body: dict[str, Any], timeout_s: float = 300.0
) -> Outcome:
    """POST `body` (chat or completions, decided by `"messages" in body`) and stream it."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    payload = dict(body, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with asyncio.timeout(timeout_s):
        resp = await post_json(pool, url, path, payload)
        try:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                raise KvtierError(f"{url}{path}: HTTP {resp.status}: {text}")
            async for raw in _lines(resp):
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise KvtierError(f"{url}{path}: stream error: {chunk['error']}")
                for choice in chunk.get("choices", ()):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        finally:
            resp.close()
    end = time.perf_counter()
    return Outcome(
        ttft_ms=1000 * ((first or end) - start),
        total_ms=1000 * (end - start),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=cached_tokens(usage) or 0,
        text="".join(pieces),
    )


def cached_tokens(usage: Mapping[str, Any]) -> int | None:
    """The prompt tokens an answer's `usage` says were served from a cache
    (`prompt_tokens_details.cached_tokens`; None where it does not say)."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


def call(
    url: str, path: str, body: object | None = None, timeout_s: float = 60.0
) -> tuple[int, bytes]:
    """One request from synchronous code: POST `body` as JSON, or GET when it is None;
    (status, body)."""

    async def once() -> tuple[int, bytes]:
        pool = new_pool(timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                resp = await (
                    pool.get(url, path) if body is None else post_json(pool, url, path, body)
                )
                try:
                    return resp.status, await resp.read()
                finally:
                    resp.close()
        finally:
            pool.close()

    return asyncio.run(once())
