"""The passes of `kvtier bench store`: each kvtier operation timed next to the plain operation
it wraps, on the same bytes, alternating which goes first (see `kvtier.tools.bench.store`)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kvtier.core.codec import BlockMeta
from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash, ModelIdentity, block_hashes, extra_key, root_hash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import L2_BATCH, TieredStore
from kvtier.core.tiers.base import BlockTier, ReadsInto
from kvtier.tools.bench.l2 import L2Target, parse_l2_spec

__all__ = [
    "CHAIN_BLOCKS",
    "EMBEDDED",
    "Geometry",
    "Seconds",
    "StoreBenchConfig",
    "geometry_of",
    "measure_l1",
    "measure_l2",
]

CHAIN_BLOCKS = 8
"""Blocks per synthetic request chain (2,048 tokens at 256 tokens per block)."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """KV shape of a model, as stored per block."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    itemsize: int = 2

    def shape(self, tokens: int) -> tuple[int, ...]:
        return (self.layers, 2, tokens, self.kv_heads, self.head_dim)

    def block_bytes(self, tokens: int) -> int:
        return self.layers * 2 * tokens * self.kv_heads * self.head_dim * self.itemsize


EMBEDDED = Geometry("SmolLM2-135M-Instruct", layers=30, kv_heads=3, head_dim=64)


def geometry_of(model_dir: str | None) -> Geometry:
    """Geometry from a HF model directory's config.json; the embedded model's by default."""
    if model_dir is None:
        return EMBEDDED
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return Geometry(
            Path(model_dir).name,
            layers=cfg["num_hidden_layers"],
            kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        )
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(f"model: cannot read the KV geometry of {model_dir!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class StoreBenchConfig:
    block_tokens: int = 256
    """Tokens per block (256 = kvtier's default block)."""
    blocks: int = 64
    """Distinct blocks per pass (64 x 5.6 MiB = 360 MiB)."""
    repeats: int = 7
    """Timed passes per figure; medians are reported."""
    l2: str | None = None
    """L2 target: `posix:PATH` (a fresh subdirectory of PATH), `juicefs` or `valkey`; None: a
    directory under the temp directory."""
    cold: bool = False
    """Drop the page cache before each read pass (root only; directory targets only)."""

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise ConfigError(f"block_tokens: must be positive, got {self.block_tokens}")
        if self.blocks < 2 * CHAIN_BLOCKS or self.blocks % CHAIN_BLOCKS:
            raise ConfigError(
                f"blocks: must be a multiple of {CHAIN_BLOCKS} and at least "
                f"{2 * CHAIN_BLOCKS}, got {self.blocks}"
            )
        if self.repeats <= 0:
            raise ConfigError(f"repeats: must be positive, got {self.repeats}")
        if parse_l2_spec(self.l2_spec)[0].startswith("valkey") and self.cold:
            raise ConfigError("cold: applies to directory targets, not valkey")

    @property
    def l2_spec(self) -> str:
        return self.l2 or f"posix:{tempfile.gettempdir()}"


def paired(
    items: int, first: Callable[[int], object], second: Callable[[int], object]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Run `first(i)` and `second(i)` for every item, alternating which goes first, so both see
    the same moments of a noisy, shared machine. Returns (wall, thread CPU) seconds of each."""
    wall, cpu = [0.0, 0.0], [0.0, 0.0]
    for i in range(items):
        order = ((0, first), (1, second)) if i % 2 == 0 else ((1, second), (0, first))
        for slot, fn in order:
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn(i)
            cpu[slot] += time.thread_time() - start_cpu
            wall[slot] += time.perf_counter() - start
    return (wall[0], cpu[0]), (wall[1], cpu[1])


def _raw_write(
    target: L2Target, names: Sequence[str], sources: Sequence[memoryview], i: int
) -> None:
    target.raw_write(names[i], sources[i])


def _raw_read(target: L2Target, names: Sequence[str], i: int) -> None:
    target.raw_read(names[i])


def _save(
    store: TieredStore,
    hashes: Sequence[BlockHash],
    metas: Sequence[BlockMeta],
    sources: Sequence[memoryview],
    i: int,
) -> None:
    store.save(hashes[i], metas[i], sources[i])


def _load_one(
    store: TieredStore, hashes: Sequence[BlockHash], dests: Sequence[memoryview], i: int
) -> None:
    (block,) = store.load(hashes[i : i + 1])
    dests[i][:] = block.payload


def _put(
    tier: BlockTier,
    hashes: Sequence[BlockHash],
    metas: Sequence[BlockMeta],
    sources: Sequence[memoryview],
    i: int,
) -> None:
    tier.put(hashes[i], metas[i], sources[i])


def _get(tier: BlockTier, hashes: Sequence[BlockHash], i: int) -> None:
    tier.get(hashes[i])


def _get_batch(tier: BlockTier, hashes: Sequence[BlockHash], i: int) -> None:
    if not all(tier.get_many(hashes[i * L2_BATCH : (i + 1) * L2_BATCH])):
        raise RuntimeError("L2 get_many missed a block that was written")


def _raw_read_batch(target: L2Target, names: Sequence[str], i: int) -> None:
    target.raw_read_many(names[i * L2_BATCH : (i + 1) * L2_BATCH])


def _read_into(tier: ReadsInto, hashes: Sequence[BlockHash], buffer: memoryview, i: int) -> None:
    if tier.read_into(hashes[i], buffer) is None:
        raise RuntimeError("L2 read_into missed a block that was written")


def _raw_read_into(target: L2Target, names: Sequence[str], buffer: memoryview, i: int) -> None:
    target.raw_read_into(names[i], buffer)


def _drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise ConfigError(
            f"cold: cannot drop the page cache ({exc}); run as root or omit --cold"
        ) from exc


def _chains(
    tag: str, n_chains: int, tokens: int, geometry: Geometry
) -> tuple[list[BlockHash], list[BlockMeta]]:
    """Hashes and metas of `n_chains` distinct request chains of CHAIN_BLOCKS blocks each."""
    hashes: list[BlockHash] = []
    metas: list[BlockMeta] = []
    shape = geometry.shape(tokens)
    for c in range(n_chains):
        extra = extra_key(cache_salt=f"{tag}/{c}")
        chain = block_hashes([7] * (tokens * CHAIN_BLOCKS), tokens, extra)
        parents = [root_hash(extra), *chain[:-1]]
        hashes += chain
        metas += [
            BlockMeta(num_tokens=tokens, dtype=geometry.dtype, shape=shape, parent=p)
            for p in parents
        ]
    return hashes, metas


Seconds = dict[str, list[tuple[float, float]]]
"""Per measurement, (wall, thread CPU) seconds of each repeat."""


def measure_l1(
    config: StoreBenchConfig,
    geometry: Geometry,
    identity: ModelIdentity,
    sources: Sequence[memoryview],
    dests: Sequence[memoryview],
    seconds: Seconds,
    step: Callable[[], object],
) -> float:
    """L1 put/get next to memcpy (every repeat); returns the seconds of the first fill."""
    tokens, n, half = config.block_tokens, config.blocks, config.blocks // 2
    n_chains = n // CHAIN_BLOCKS

    def memcpy(i: int) -> None:
        dests[i % half][:] = sources[i]

    # L1 holds half of the blocks: after the first (fill) pass, every save evicts.
    with TieredStore(
        StoreSettings(l1_bytes=half * geometry.block_bytes(tokens)), identity
    ) as store:
        hashes, metas = _chains("fill", n_chains, tokens, geometry)
        start = time.perf_counter()
        for i in range(n):
            store.save(hashes[i], metas[i], sources[i])
        fill_s = time.perf_counter() - start
        step()
        for r in range(config.repeats):
            hashes, metas = _chains(f"l1/{r}", n_chains, tokens, geometry)
            t_copy, t_put = paired(n, memcpy, partial(_save, store, hashes, metas, sources))
            held = hashes[-half:]  # the newest chains, which L1 holds now
            t_copy2, t_get = paired(half, memcpy, partial(_load_one, store, held, dests))
            for name, t in (
                ("memcpy", t_copy),
                ("l1_put", t_put),
                ("memcpy_get_pair", t_copy2),
                ("l1_get", t_get),
            ):
                seconds[name].append(t)
            step()
    return fill_s


def measure_l2(
    config: StoreBenchConfig,
    geometry: Geometry,
    identity: ModelIdentity,
    target: L2Target,
    sources: Sequence[memoryview],
    seconds: Seconds,
    step: Callable[[], object],
) -> None:
    """The L2 tier next to the raw operations, on the same target and bytes (every repeat)."""
    tokens, n = config.block_tokens, config.blocks
    size = geometry.block_bytes(tokens)
    writer, reader = target.open_tier(identity), target.open_tier(identity, reader=True)
    names = [f"{i:04d}.bin" for i in range(n)]
    # The same keys every repeat (removed in between, fan-out directories stay): the steady
    # state of a long-running L2.
    hashes, metas = _chains("l2", n // CHAIN_BLOCKS, tokens, geometry)
    try:
        for _ in range(config.repeats):
            os.sync()
            t_raw_w, t_l2_w = paired(
                n,
                partial(_raw_write, target, names, sources),
                partial(_put, writer, hashes, metas, sources),
            )
            target.settle()
            if config.cold:
                _drop_page_cache()
            else:
                os.sync()
            hits = reader.stats().hits
            t_raw_r, t_l2_r = paired(
                n, partial(_raw_read, target, names), partial(_get, reader, hashes)
            )
            if reader.stats().hits - hits != n:
                raise RuntimeError("L2 read back fewer blocks than were written")
            for name, t in (
                ("raw_write", t_raw_w),
                ("l2_write", t_l2_w),
                ("raw_read", t_raw_r),
                ("l2_read", t_l2_r),
            ):
                seconds[name].append(t)
            if target.url is not None:
                # The store's load of an L2 hit from a network tier: batches of `L2_BATCH` blocks
                t_raw_b, t_l2_b = paired(
                    -(-n // L2_BATCH),
                    partial(_raw_read_batch, target, names),
                    partial(_get_batch, reader, hashes),
                )
                seconds.setdefault("raw_read_batch", []).append(t_raw_b)
                seconds.setdefault("l2_read_batch", []).append(t_l2_b)
            if isinstance(reader, ReadsInto) and target.url is None:
                # The connector's path: into a staging buffer each side reuses (pre-faulted).
                if config.cold:
                    _drop_page_cache()
                mine, theirs = (memoryview(bytearray(size)) for _ in range(2))
                t_raw_i, t_l2_i = paired(
                    n,
                    partial(_raw_read_into, target, names, theirs),
                    partial(_read_into, reader, hashes, mine),
                )
                seconds.setdefault("raw_read_into", []).append(t_raw_i)
                seconds.setdefault("l2_read_into", []).append(t_l2_i)
            for h, name in zip(hashes, names, strict=True):
                writer.remove(h)
                target.raw_remove(name)
            step()
    finally:
        writer.close()
        reader.close()
