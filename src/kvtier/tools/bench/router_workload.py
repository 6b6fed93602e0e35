"""S3's workload: documents x questions, interleaved in rounds, and the hits an ideal router
would get (see `kvtier.tools.bench.router`)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Workload", "build_workload", "ideal_hit_tokens"]


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: tuple[str, ...]
    """Interleaved request prompts."""
    ideal_hit_tokens: int
    """Prefix-cache hit tokens if every request landed where its prefix was cached."""


def ideal_hit_tokens(prompts_ids: Sequence[Sequence[int]], block_tokens: int) -> int:
    """Prefix-cache hit tokens if every request landed where its longest earlier-seen prefix
    was cached: per request, the full blocks it shares with any earlier request (the engine
    always recomputes the last token, so a prompt's last token never counts)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for ids in prompts_ids:
        chain = [
            tuple(ids[: (k + 1) * block_tokens]) for k in range((len(ids) - 1) // block_tokens)
        ]
        total += block_tokens * next(
            (k for k, blocks in enumerate(chain) if blocks not in seen), len(chain)
        )
        seen.update(chain)
    return total


def build_workload(
    tokenizer: Any,
    corpus: Any,
    tag: str,
    prefixes: int,
    suffixes: int,
    prefix_tokens: int,
    suffix_tokens: int = 0,
    system_tokens: int = 0,
    *,
    block_tokens: int,
) -> Workload:
    """`suffix_tokens` > 0 puts a context of its own before each question (retrieved passages,
    an agent's tool output), so the shared prefix is only part of the prompt; `system_tokens`
    > 0 opens every prompt with one system prompt shared by all documents (a service's
    instructions and tool schemas)."""

    def text(tokens: int, head: str, seed_tag: str) -> str:
        body = corpus.encode(corpus.document(tokens, seed=zlib.crc32(seed_tag.encode())))
        return str(corpus.decode((corpus.encode(head) + body)[:tokens]))

    system = (
        text(system_tokens, f"System {tag}.\n", f"{tag}-system") + "\n" if system_tokens else ""
    )
    docs = [text(prefix_tokens, f"Document {tag}-{p}.\n", f"{tag}-{p}") for p in range(prefixes)]
    prompts = []
    rng = random.Random(zlib.crc32(tag.encode()))
    half = prefixes // 2
    order = list(range(prefixes))
    for s in range(suffixes):
        # Each round visits every prefix once in a fresh order (a fixed order would let round
        # robin map prefix p to replica p mod 2 and look perfectly affine by accident); halves
        # are shuffled separately so a prefix recurs no sooner than half a round later, after
        # its previous request's prefill.
        order = rng.sample(order[:half], half) + rng.sample(order[half:], prefixes - half)
        for p in order:
            context = (
                corpus.document(suffix_tokens, seed=zlib.crc32(f"{tag}-{p}-{s}".encode())) + "\n"
                if suffix_tokens
                else ""
            )
            prompts.append(
                f"{system}{docs[p]}\n{context}Question {s}: what does document {p} "
                f"say about item {s * 7 + p}?"
            )
    return Workload(
        tuple(prompts), ideal_hit_tokens([tokenizer.encode(p) for p in prompts], block_tokens)
    )
