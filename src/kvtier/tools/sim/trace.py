"""Request traces in the Mooncake JSONL format, loaded for replay by the fleet simulator.

One JSON object per line: `timestamp` (ms from the start), `input_length` and `output_length`
(tokens), `hash_ids` (one id per `block_tokens`-token block of the prompt; ids are chained, so
two requests share their first k ids exactly when their first k blocks are identical; the last
id may cover a partial block). Ids are opaque ints: `block_hash` turns one into the `BlockHash`
bytes the router's index and policies take, deterministically.

An id names a whole prefix, so one prompt never holds the same id twice (a real prompt's blocks
at two positions have prefixes of different lengths): a line repeating an id is malformed and
rejected, rather than replayed with an ideal hit rate no cache could reach.

A file whose name ends in `.gz` is read through gzip. `BUNDLED_TRACE` is the Mooncake
conversation trace shipped with kvtier (`data/README.md`: its origin and licence).
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvtier.core.errors import ConfigError
from kvtier.core.keys import HASH_BYTES, BlockHash

__all__ = [
    "BUNDLED_TRACE",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceRequest",
    "block_hash",
    "load_trace",
    "open_trace",
]

BUNDLED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"
"""The Mooncake conversation trace (12,031 requests), the default of the trace commands."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""
_ID_LIMIT = 1 << (8 * HASH_BYTES)


def block_hash(block_id: int) -> BlockHash:
    """The `BlockHash` naming a trace block id (16-byte little-endian)."""
    return BlockHash(block_id.to_bytes(HASH_BYTES, "little"))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float
    """Arrival time, seconds from the start of the trace."""
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    """Trace block ids of the prompt, in order."""
    hashes: tuple[BlockHash, ...]
    """`block_hash` of each of `blocks` (precomputed: the router is asked once per request)."""


@dataclass(frozen=True, slots=True)
class Trace:
    """An ordered list of requests plus the block size their ids stand for."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ConfigError(f"block_tokens: must be positive, got {self.block_tokens}")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def block_token_counts(self, request: TraceRequest) -> list[int]:
        """Tokens in each block of `request` (the last may be partial)."""
        full, tail = divmod(request.input_tokens, self.block_tokens)
        counts = [self.block_tokens] * full
        if tail:
            counts.append(tail)
        return counts

    def total_blocks(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    def unique_blocks(self) -> int:
        return len({b for r in self.requests for b in r.blocks})

    def ideal_hit_rate(self) -> float:
        """Block hit rate of one infinite cache: blocks seen before over all blocks.

        Computed by set membership, independently of the simulator's caches and prefix walks.
        """
        seen: set[int] = set()
        hits = total = 0
        for request in self.requests:
            for block in request.blocks:
                total += 1
                if block in seen:
                    hits += 1
                else:
                    seen.add(block)
        return hits / total if total else 0.0


def load_trace(
    path: str | Path,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Read a Mooncake JSONL trace.

    `limit` keeps the first N requests; `time_scale` multiplies arrival times (2.0 halves the
    request rate). Requests are sorted by arrival (stable), as the simulator replays them.
    """
    if limit is not None and limit <= 0:
        raise ConfigError(f"limit: must be positive, got {limit}")
    if not time_scale > 0:
        raise ConfigError(f"time_scale: must be positive, got {time_scale}")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"trace: {path} is a directory")
    if not path.is_file():
        raise ConfigError(f"trace: no such file: {path}")
    requests: list[TraceRequest] = []
    try:
        with open_trace(path) as lines:
            for lineno, line in enumerate(lines, 1):
                if limit is not None and len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_parse(line, f"{path}:{lineno}", time_scale, block_tokens))
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # (EOFError: a truncated .gz)
        raise ConfigError(f"trace: cannot read {path} as JSONL text ({exc})") from None
    if not requests:
        raise ConfigError(f"trace: {path} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(tuple(requests), block_tokens)


def _parse(line: str, where: str, time_scale: float, block_tokens: int) -> TraceRequest:
    try:
        doc = json.loads(line)
        arrival_ms = float(doc["timestamp"])
        input_tokens = int(doc["input_length"])
        output_tokens = int(doc["output_length"])
        if not isinstance(doc["hash_ids"], list):
            raise TypeError(f"hash_ids: expected a list, got {doc['hash_ids']!r}")
        blocks = tuple(int(b) for b in doc["hash_ids"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"trace: {where}: not a Mooncake trace line ({exc})") from exc
    if not math.isfinite(arrival_ms):
        raise ConfigError(f"trace: {where}: timestamp {arrival_ms} is not a finite number")
    if input_tokens < 0 or output_tokens < 0 or arrival_ms < 0:
        raise ConfigError(f"trace: {where}: negative timestamp or length")
    if len(blocks) != math.ceil(input_tokens / block_tokens):
        raise ConfigError(
            f"trace: {where}: {len(blocks)} hash ids for {input_tokens} tokens "
            f"of {block_tokens}-token blocks"
        )
    if any(not 0 <= b < _ID_LIMIT for b in blocks):
        raise ConfigError(f"trace: {where}: hash id outside [0, 2**128)")
    _check_distinct(blocks, where)
    return TraceRequest(
        arrival_s=arrival_ms / 1000.0 * time_scale,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        blocks=blocks,
        hashes=tuple(block_hash(b) for b in blocks),
    )


def _check_distinct(blocks: tuple[int, ...], where: str) -> None:
    """Reject a prompt naming one block id twice (ids are chained: see the module docstring)."""
    if len(set(blocks)) == len(blocks):
        return
    seen: set[int] = set()
    for position, block in enumerate(blocks):
        if block in seen:
            raise ConfigError(
                f"trace: {where}: hash id {block} repeats at block {position}; chained ids "
                f"never repeat within one prompt"
            )
        seen.add(block)


def open_trace(path: Path) -> TextIO:
    """`path` opened as UTF-8 text, through gzip when its name ends in `.gz`."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")
