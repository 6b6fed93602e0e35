"""An OpenAI-API load client that measures what the benchmarks report.

One streamed request per call; TTFT is the time from sending the request to the first streamed
token. The final usage chunk (`stream_options.include_usage`) gives prompt tokens and, when the
server runs with `--enable-prompt-tokens-details`, the tokens it served from any cache tier
(`prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvtier.core.errors import KvtierError


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    text: str


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                         timeout_s: float = 300.0) -> Outcome:
    """POST `body` (chat or completions, decided by `"messages" in body`) and stream it."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    payload = dict(body, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(url + path, json=payload,
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise KvtierError(f"{url}{path}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
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
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(ttft_ms=1000 * ((first or end) - start), total_ms=1000 * (end - start),
                   prompt_tokens=int(usage.get("prompt_tokens", 0)),
                   cached_tokens=int(details.get("cached_tokens") or 0), text="".join(pieces))
