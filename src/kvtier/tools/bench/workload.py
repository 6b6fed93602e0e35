"""Workloads as sessions of turns, replayed against an OpenAI endpoint with their timing.

A session is a conversation (S2 chat: each turn sees the earlier turns and answers) or a single
request (S4 trace, S5 RAG). Sessions start at their arrival offset; within a session a turn
starts after the previous answer plus a think time. Every request records what the reports
need: TTFT, prompt tokens, tokens served from cache, and the *reusable* tokens — the longest
prefix, in full engine blocks, that an earlier request of the run already sent (what an ideal
fleet-wide cache could have served).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from kvtier.core.errors import KvtierError
from kvtier.core.keys import block_hashes
from kvtier.net.http_client import HttpPool
from kvtier.tools.bench.client import new_pool, stream_request


@dataclass(frozen=True, slots=True)
class Turn:
    content: str | None = None
    """User message of a chat turn (None for a raw completion)."""
    prompt_ids: tuple[int, ...] = ()
    """Token ids of a raw completion prompt (trace replay)."""
    max_tokens: int = 20


@dataclass(frozen=True, slots=True)
class Session:
    start_s: float
    turns: tuple[Turn, ...]
    system: str | None = None
    think_s: float = 0.0
    name: str = ""


@dataclass(frozen=True, slots=True)
class Record:
    session: str
    round: int
    start_s: float
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int
    error: str | None = None


@dataclass
class _Seen:
    """Engine-block hashes of every prompt sent so far in this run."""

    block_tokens: int
    hashes: set[bytes] = field(default_factory=set)

    def reusable(self, ids: Sequence[int]) -> int:
        """Tokens of `ids`' longest prefix already sent (the last token is always computed)."""
        chain = block_hashes(ids[: max(len(ids) - 1, 0)], self.block_tokens)
        hit = 0
        for h in chain:
            if h not in self.hashes:
                break
            hit += 1
        self.hashes.update(chain)
        return hit * self.block_tokens


class Runner:
    """Replays sessions against `url`, bounded by `deadline_s` of wall time."""

    def __init__(
        self,
        url: str,
        model: str,
        tokenizer: Any,
        *,
        engine_block_tokens: int = 128,
        deadline_s: float = 1800.0,
        progress: bool = True,
    ) -> None:
        self.url = url
        self.model = model
        self.tokenizer = tokenizer
        self.deadline_s = deadline_s
        self.progress = progress
        self._seen = _Seen(engine_block_tokens)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    async def _run_session(
        self,
        http: HttpPool,
        session: Session,
        t0: float,
        out: list[Record],
        bar: Callable[[], object],
    ) -> None:
        await asyncio.sleep(max(0.0, t0 + session.start_s - time.perf_counter()))
        messages: list[dict[str, str]] = []
        if session.system is not None:
            messages.append({"role": "system", "content": session.system})
        for index, turn in enumerate(session.turns):
            if time.perf_counter() - t0 > self.deadline_s:
                return
            body: dict[str, Any] = {
                "model": self.model,
                "max_tokens": turn.max_tokens,
                "temperature": 0.0,
            }
            if turn.content is not None:
                messages.append({"role": "user", "content": turn.content})
                body["messages"] = list(messages)
                ids = self._chat_ids(messages)
            else:
                body["prompt"] = list(turn.prompt_ids)
                ids = list(turn.prompt_ids)
            reusable = self._seen.reusable(ids)
            started = time.perf_counter() - t0
            try:
                result = await stream_request(http, self.url, body)
            except (TimeoutError, OSError, KvtierError, ValueError) as exc:
                # recorded, the run goes on
                out.append(
                    Record(
                        session.name,
                        index,
                        started,
                        0.0,
                        0.0,
                        len(ids),
                        0,
                        reusable,
                        error=f"{type(exc).__name__}: {exc}"[:300],
                    )
                )
                bar()
                return
            out.append(
                Record(
                    session.name,
                    index,
                    started,
                    result.ttft_ms,
                    result.total_ms,
                    result.prompt_tokens or len(ids),
                    result.cached_tokens,
                    reusable,
                )
            )
            bar()
            if turn.content is not None:
                messages.append({"role": "assistant", "content": result.text})
            await asyncio.sleep(session.think_s)

    async def run(self, sessions: Sequence[Session], label: str = "") -> list[Record]:
        out: list[Record] = []
        total = sum(len(s.turns) for s in sessions)
        with tqdm(
            total=total, desc=label or "requests", unit="req", disable=not self.progress
        ) as bar:
            http = new_pool()
            try:
                t0 = time.perf_counter()
                await asyncio.gather(
                    *(self._run_session(http, s, t0, out, bar.update) for s in sessions)
                )
            finally:
                http.close()
        return sorted(out, key=lambda r: r.start_s)
