"""Shared helpers of the simulator tests: the real Mooncake trace, tiny traces, a reference LRU."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.tools.sim.cost_model import CostModel
from kvtier.tools.sim.trace import BUNDLED_TRACE

MOONCAKE = BUNDLED_TRACE
"""The Mooncake conversation trace (12,031 requests); ideal block hit rate 36.6%."""


def write_trace(path: Path, rows: Iterable[tuple[float, int, int, Sequence[int]]]) -> Path:
    """Write (timestamp_ms, input_length, output_length, hash_ids) rows as Mooncake JSONL."""
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": ts,
                    "input_length": n_in,
                    "output_length": n_out,
                    "hash_ids": list(ids),
                }
            )
            + "\n"
            for ts, n_in, n_out, ids in rows
        )
    )
    return path


def reference_lru_hits(requests: Iterable[Sequence[int]], capacity: float) -> int:
    """Prefix-cache hits of one tail-first LRU cache of `capacity` blocks, computed
    independently, block by block as kvtier's L1 (`kvtier.core.tiers.memory`) stores a chain.

    Per request: count the leading blocks present, then write the blocks in order: each one,
    then its ancestors, become most recent (root last), after evicting the least recent blocks
    to make room; a block that does not fit with its ancestors is refused, and so is the rest
    of the chain (nothing left to hang it on).
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for blocks in requests:
        for block in blocks:
            if block not in cache:
                break
            hits += 1
        for i in range(len(blocks)):
            if i + 1 > capacity:
                break
            chain = blocks[i::-1]
            for block in chain:
                cache.pop(block, None)
            while len(cache) + len(chain) > capacity:
                cache.popitem(last=False)
            for block in chain:
                cache[block] = None
    return hits


def make_costs(**changes: Any) -> CostModel:
    """Round numbers for hand-computed TTFTs: 512 tokens prefill in 0.5 s, read from L1 in
    0.25 s, from L2 in 0.125 s; no overhead; an unbounded pool."""
    base = CostModel(
        prefill_tokens_per_s=1024.0,
        request_overhead_s=0.0,
        decode_tokens_per_s=10.0,
        kv_bytes_per_token=1000,
        l1_read_bytes_per_s=2.048e6,
        l2_read_bytes_per_s=4.096e6,
        l2_pool_read_bytes_per_s=math.inf,
        l0_gib=1.0,
        l1_gib=2.0,
        l2_gib=0.0,
    )
    return replace(base, **changes)
