"""The workloads of DESIGN.md §8, sized for a 2-core machine and the embedded model.

- S2 chat: users share a system prompt; each user opens with a document of their own (a file
  pasted into the chat), then each round adds a user message and a short answer. The document
  is what makes history worth caching: without it the growing history stays small next to the
  always-hot system prompt, and every configuration looks alike.
- S4 trace: the Mooncake conversation trace, each 512-token trace block scaled down to
  `tokens_per_block` real tokens; a trace block id always maps to the same tokens, so the
  trace's prefix sharing is kept exactly.
- S5 RAG: a few long documents, each asked many questions.
Arrivals are Poisson (seeded), so every run of a scenario sends the same requests.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.errors import ConfigError
from kvtier.tools.bench.corpus import Corpus, paragraphs
from kvtier.tools.bench.workload import Session, Turn
from kvtier.tools.sim.trace import open_trace


@dataclass(frozen=True, slots=True)
class ChatShape:
    users: int = 4
    rounds: int = 6
    system_tokens: int = 500
    document_tokens: int = 1500
    """Each user's own document, sent in the first round (0: none)."""
    user_tokens: int = 80
    answer_tokens: int = 20
    arrival_rate_per_s: float = 0.5
    think_s: float = 10.0
    """A user reads the answer before the next round: keeps two one-core replicas from
    saturating, so TTFT measures the cache rather than a queue."""


def chat_sessions(corpus: Corpus, shape: ChatShape, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    system = "You are a helpful assistant. Use this reference:\n" + corpus.document(
        shape.system_tokens, seed=10_000 + seed
    )
    sessions, start = [], 0.0
    for user in range(shape.users):
        opening = (
            f"My document:\n{corpus.document(shape.document_tokens, seed=40_000 + user)}\n\n"
            if shape.document_tokens
            else ""
        )
        turns = tuple(
            Turn(
                content=(opening if r == 0 else "")
                + corpus.document(shape.user_tokens, seed=seed * 1_000_003 + user * 101 + r)
                + "\nSummarize the above in one sentence.",
                max_tokens=shape.answer_tokens,
            )
            for r in range(shape.rounds)
        )
        sessions.append(
            Session(
                start_s=start, turns=turns, system=system, think_s=shape.think_s, name=f"user{user}"
            )
        )
        start += rng.expovariate(shape.arrival_rate_per_s)
    return sessions


@dataclass(frozen=True, slots=True)
class RagShape:
    documents: int = 4
    document_tokens: int = 1500
    questions: int = 24
    arrival_rate_per_s: float = 1.0
    answer_tokens: int = 16


def rag_sessions(corpus: Corpus, shape: RagShape, seed: int = 0) -> list[Session]:
    rng = random.Random(seed)
    docs = [corpus.document(shape.document_tokens, seed=20_000 + d) for d in range(shape.documents)]
    sessions, start = [], 0.0
    for q in range(shape.questions):
        doc = rng.randrange(shape.documents)
        question = corpus.document(30, seed=30_000 + q)
        sessions.append(
            Session(
                start_s=start,
                name=f"q{q}-doc{doc}",
                turns=(
                    Turn(
                        content=f"Document:\n{docs[doc]}\n\nQuestion: {question}\nAnswer briefly.",
                        max_tokens=shape.answer_tokens,
                    ),
                ),
            )
        )
        start += rng.expovariate(shape.arrival_rate_per_s)
    return sessions


@dataclass(frozen=True, slots=True)
class TraceShape:
    requests: int = 120
    tokens_per_block: int = 128
    """Real tokens standing in for one 512-token trace block: one engine block (vLLM CPU), so
    requests sharing k trace blocks share k full engine blocks."""
    max_blocks: int = 8
    """Longer prompts are cut to this many trace blocks (CPU budget: 1,024 tokens)."""
    time_scale: float = 2.0
    """Trace time is multiplied by this (2.0: half speed; the first 120 requests span 42 s of
    trace time, which 2 one-core replicas cannot prefill in real time)."""
    answer_tokens: int = 8


def trace_sessions(corpus: Corpus, path: Path, shape: TraceShape) -> list[Session]:
    """The first `shape.requests` requests of a Mooncake-format JSONL trace (gzipped if its
    name ends in .gz)."""
    try:
        with open_trace(path) as text:
            lines = list(itertools.islice(text, shape.requests))
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, EOFError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable Mooncake JSONL trace ({exc})") from exc
    stream = corpus.encode("\n\n".join(paragraphs()))
    span = len(stream) - shape.tokens_per_block

    def block(hash_id: int) -> list[int]:
        offset = random.Random(hash_id).randrange(span)
        return stream[offset : offset + shape.tokens_per_block]

    sessions = []
    t0 = rows[0]["timestamp"] if rows else 0
    for i, row in enumerate(rows):
        ids: list[int] = []
        for hash_id in row["hash_ids"][: shape.max_blocks]:
            ids += block(int(hash_id))
        scaled_len = max(1, row["input_length"] * shape.tokens_per_block // 512)
        ids = ids[: min(scaled_len, shape.max_blocks * shape.tokens_per_block)]
        sessions.append(
            Session(
                start_s=(row["timestamp"] - t0) / 1000 * shape.time_scale,
                name=f"r{i}",
                turns=(Turn(prompt_ids=tuple(ids), max_tokens=shape.answer_tokens),),
            )
        )
    return sessions
