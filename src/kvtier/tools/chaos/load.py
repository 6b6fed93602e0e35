"""Steady, bounded load for the chaos runs, and what each client saw.

`Load` sends a fixed mix through the router: chat and completions, streaming and not, over
prompts that share prefixes, greedy (temperature 0, `ignore_eos`, a fixed number of tokens), so
every answer has one right output: the `reference` the fleet gave before any fault. Workers
send one request at a time each (the load is bounded by their number); every request becomes a
`Record` of what the client saw: an answer, an HTTP error, a stream that ended with an error
event, a stream cut without one, or no answer within the timeout (a hang).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.net.http_client import HttpPool, Response
from kvtier.tools.bench.client import JSON, cached_tokens

REFERENCE_ATTEMPTS = 5
"""Tries of each fault-free reference request before the run gives up."""

__all__ = ["Load", "Record", "RequestKey", "prompts_with_shared_prefixes"]


@dataclass(frozen=True, slots=True)
class RequestKey:
    prompt: int
    chat: bool
    stream: bool


@dataclass(frozen=True, slots=True)
class Record:
    key: RequestKey
    started: float
    """`time.monotonic()` when the request was sent."""
    ended: float
    outcome: str
    """ok | http_error | stream_error_event | stream_cut | hang | connect_error"""
    text: str = ""
    detail: str = ""
    replica: str = ""
    """The replica that answered (the router's `x-kvtier-replica` header), if it did."""
    cached_tokens: int | None = None
    """Prompt tokens the replica served from a cache tier (`usage.prompt_tokens_details`), if
    it said so."""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def prompts_with_shared_prefixes(
    tokenizer: object, prefixes: int, suffixes: int, prefix_tokens: int, suffix_tokens: int
) -> list[str]:
    """`prefixes` x `suffixes` prompts: each prefix shared by `suffixes` prompts."""
    from kvtier.tools.bench.corpus import Corpus

    corpus = Corpus(tokenizer)
    out = []
    for p in range(prefixes):
        head = corpus.document(prefix_tokens, seed=1000 + p)
        for s in range(suffixes):
            out.append(head + "\n\nQuestion: " + corpus.document(suffix_tokens, seed=77 * p + s))
    return out


class Load:
    def __init__(
        self,
        url: str,
        model: str,
        prompts: Sequence[str],
        *,
        workers: int = 3,
        max_tokens: int = 8,
        timeout_s: float = 120.0,
    ) -> None:
        self.url = url
        self.model = model
        self.prompts = list(prompts)
        self.workers = workers
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.keys = [
            RequestKey(p, chat, stream)
            for p in range(len(self.prompts))
            for chat in (False, True)
            for stream in (False, True)
        ]

    def body(self, key: RequestKey) -> tuple[str, bytes]:
        doc: dict[str, object] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": key.stream,
        }
        if key.stream:
            doc["stream_options"] = {"include_usage": True}
        if key.chat:
            doc["messages"] = [{"role": "user", "content": self.prompts[key.prompt]}]
            return "/v1/chat/completions", json.dumps(doc).encode()
        doc["prompt"] = self.prompts[key.prompt]
        return "/v1/completions", json.dumps(doc).encode()

    async def one(self, pool: HttpPool, key: RequestKey) -> Record:
        path, body = self.body(key)
        started = time.monotonic()
        replica = ""

        def record(
            outcome: str, text: str = "", detail: str = "", cached: int | None = None
        ) -> Record:
            ended = time.monotonic()
            return Record(key, started, ended, outcome, text, detail[:300], replica, cached)

        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    resp = await pool.post(self.url, path, body, JSON)
                except OSError as exc:
                    return record("connect_error", detail=str(exc))
                replica = _header(resp.headers, b"x-kvtier-replica")
                try:
                    if resp.status != 200:
                        raw = await resp.read()
                        return record("http_error", detail=f"{resp.status} {raw[:200]!r}")
                    if not key.stream:
                        doc = json.loads(await resp.read())
                        return record(
                            "ok", _text(doc), cached=cached_tokens(doc.get("usage") or {})
                        )
                    return await self._stream(resp, record)
                finally:
                    resp.close()
        except TimeoutError:
            return record("hang", detail=f"no complete answer within {self.timeout_s} s")
        except OSError as exc:
            return record("stream_cut" if key.stream else "http_error", detail=str(exc))
        except ValueError as exc:
            return record("http_error", detail=f"bad answer: {exc}")

    async def _stream(self, resp: Response, record: Callable[..., Record]) -> Record:
        pending, pieces, cached = b"", list[str](), None
        while chunk := await resp.chunk():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return record("ok", "".join(pieces), cached=cached)
                doc = json.loads(data)
                if "error" in doc:
                    return record("stream_error_event", detail=str(doc["error"]))
                pieces.append(_text(doc))
                cached = cached_tokens(doc["usage"]) if doc.get("usage") else cached
        return record("stream_cut", detail="stream ended without [DONE] or an error event")

    async def reference(self) -> dict[RequestKey, str]:
        """Every prompt once per endpoint, not streamed, fault-free: the outputs every later
        answer must equal, streamed or not (greedy decoding has one right answer). A request
        that fails is sent again (`REFERENCE_ATTEMPTS` in all): no fault is injected yet, and a
        busy 2-core machine may time out one connection."""
        pool = HttpPool(10.0, self.timeout_s)
        try:
            queue = [k for k in self.keys if not k.stream]
            found: dict[RequestKey, str] = {}

            async def worker() -> None:
                while queue:
                    key = queue.pop()
                    for attempt in range(REFERENCE_ATTEMPTS):
                        rec = await self.one(pool, key)
                        if rec.ok:
                            break
                        await asyncio.sleep(2.0 * (attempt + 1))
                    else:
                        raise RuntimeError(f"reference request {key} failed: {rec.detail}")
                    found[key] = found[RequestKey(key.prompt, key.chat, True)] = rec.text

            await asyncio.gather(*(worker() for _ in range(self.workers)))
            return found
        finally:
            pool.close()

    async def run(self, stop: asyncio.Event, offset: int = 0) -> list[Record]:
        """Send requests with `workers` concurrent clients until `stop` is set."""
        pool = HttpPool(10.0, self.timeout_s)
        records: list[Record] = []
        cycle = itertools.cycle(self.keys[offset:] + self.keys[:offset])
        try:

            async def worker() -> None:
                while not stop.is_set():
                    records.append(await self.one(pool, next(cycle)))
                    if records[-1].outcome == "connect_error":
                        await asyncio.sleep(0.2)  # the router is down: do not spin

            await asyncio.gather(*(worker() for _ in range(self.workers)))
        finally:
            pool.close()
        return records


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    return next((v.decode("latin-1") for k, v in headers if k.lower() == name), "")


def _text(doc: dict[str, Any]) -> str:
    out = []
    for choice in doc.get("choices") or ():
        out.append(
            choice.get("text")
            or (choice.get("message") or {}).get("content")
            or (choice.get("delta") or {}).get("content")
            or ""
        )
    return "".join(out)
