"""`kvtier bench store`: the tiers' data path next to the plain copies it wraps, in one run.

Every figure is GB/s (10^9 bytes/s) of block payload, the median of `--repeats` passes over
`--blocks` distinct blocks of the embedded model's real size (256 tokens x 30 layers x K,V x
3 heads x 64 dims x bf16 = 5,898,240 bytes; random bytes). kvtier and its baseline alternate
block by block (which goes first alternates too), over the same bytes, so both see the same
moments of a shared, noisy machine:

    l1_put_gbps    TieredStore.save (admission, one copy into L1, LRU, eviction) with L1 full,
                   i.e. in steady state; the first fill of an empty L1 is `l1_put_fill_gbps`.
    memcpy_gbps    the same payloads copied into pre-allocated, pre-faulted buffers (the best
                   case any copy can reach; L1 needs one copy per saved block).
    l1_get_gbps    TieredStore.load of chains held in L1, plus copying each payload out into a
                   pre-allocated buffer (what a consumer does with a zero-copy view).
    l2_write_gbps  the L2 tier's put: encode + xxh3 checksum + publish (a directory: unique temp
                   file + link into the fan-out layout; Valkey: SET NX), one thread.
    raw_write_gbps the plain write of the same bytes on the same target: open(), write() and
                   close() of plain files in the same directory (Valkey: SET).
    l2_read_gbps   the L2 tier's get: header validation, payload into a fresh buffer, checksum
                   verification.
    raw_read_gbps  the plain read: open() + read() of the plain files into a fresh buffer
                   (Python's `f.read()`; Valkey: GET).

`--l2` picks the target (`kvtier.tools.bench.l2`, which starts and removes it): `posix:PATH`
(default: the temp directory) benchmarks a fresh subdirectory of PATH; `juicefs` a fresh
JuiceFS volume mounted twice, written through one mount and read through the other (another
"node"); `valkey` a fresh loopback Valkey server.

Each figure is computed twice: from wall-clock time (the headline figures) and from the
benchmark thread's CPU time (`cpu` in the JSON), which stays meaningful when other processes
oversubscribe the machine; `load_average` (before and after) records how busy it was. For
JuiceFS and Valkey much of the work happens in other processes (the FUSE daemons, the server),
so read their wall-clock figures.

Page cache: warm for both by default (files were just written); `--cold` syncs and drops the
page cache before every read pass (needs root; directory targets only). Dirty data is synced
before each timed pass, untimed, so one writer never pays for the other's writeback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.codec import HEADER_BYTES, BlockMeta
from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash, ModelIdentity, block_hashes, extra_key, root_hash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import BlockTier
from kvtier.tools.bench.l2 import L2Target, l2_target, parse_l2_spec

TARGET_RATIO = 0.7
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
        if parse_l2_spec(self.l2_spec)[0] == "valkey" and self.cold:
            raise ConfigError("cold: applies to directory targets, not valkey")

    @property
    def l2_spec(self) -> str:
        return self.l2 or f"posix:{tempfile.gettempdir()}"


# ---- timed steps -------------------------------------------------------------------------------


def _paired(
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


def _figures(seconds: dict[str, list[float]], moved: dict[str, int]) -> dict[str, Any]:
    """Median GB/s of each measurement, the four kvtier/baseline ratios, and per-repeat GB/s."""
    gbps = {name: [round(moved[name] / t / 1e9, 3) for t in ts] for name, ts in seconds.items()}
    med = {f"{name}_gbps": statistics.median(v) for name, v in gbps.items()}
    ratios = {
        "l1_put_ratio": med["l1_put_gbps"] / med["memcpy_gbps"],
        "l1_get_ratio": med["l1_get_gbps"] / med["memcpy_get_pair_gbps"],
        "l2_write_ratio": med["l2_write_gbps"] / med["raw_write_gbps"],
        "l2_read_ratio": med["l2_read_gbps"] / med["raw_read_gbps"],
    }
    return {
        **med,
        **{k: round(v, 3) for k, v in ratios.items()},
        "meets_target": all(v >= TARGET_RATIO for v in ratios.values()),
        "per_repeat_gbps": gbps,
    }


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


# ---- the run -----------------------------------------------------------------------------------

Seconds = dict[str, list[tuple[float, float]]]
"""Per measurement, (wall, thread CPU) seconds of each repeat."""


def _measure_l1(
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
            t_copy, t_put = _paired(n, memcpy, partial(_save, store, hashes, metas, sources))
            held = hashes[-half:]  # the newest chains, which L1 holds now
            t_copy2, t_get = _paired(half, memcpy, partial(_load_one, store, held, dests))
            for name, t in (
                ("memcpy", t_copy),
                ("l1_put", t_put),
                ("memcpy_get_pair", t_copy2),
                ("l1_get", t_get),
            ):
                seconds[name].append(t)
            step()
    return fill_s


def _measure_l2(
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
    writer, reader = target.open_tier(identity), target.open_tier(identity, reader=True)
    names = [f"{i:04d}.bin" for i in range(n)]
    # The same keys every repeat (removed in between, fan-out directories stay): the steady
    # state of a long-running L2.
    hashes, metas = _chains("l2", n // CHAIN_BLOCKS, tokens, geometry)
    try:
        for r in range(config.repeats):
            os.sync()
            t_raw_w, t_l2_w = _paired(
                n,
                partial(_raw_write, target, names, sources),
                partial(_put, writer, hashes, metas, sources),
            )
            target.settle()
            if config.cold:
                _drop_page_cache()
            else:
                os.sync()
            t_raw_r, t_l2_r = _paired(
                n, partial(_raw_read, target, names), partial(_get, reader, hashes)
            )
            if reader.stats().hits != (r + 1) * n:
                raise RuntimeError("L2 read back fewer blocks than were written")
            for name, t in (
                ("raw_write", t_raw_w),
                ("l2_write", t_l2_w),
                ("raw_read", t_raw_r),
                ("l2_read", t_l2_r),
            ):
                seconds[name].append(t)
            for h, name in zip(hashes, names, strict=True):
                writer.remove(h)
                target.raw_remove(name)
            step()
    finally:
        writer.close()
        reader.close()


def run(
    config: StoreBenchConfig, geometry: Geometry = EMBEDDED, *, progress: bool = True
) -> dict[str, Any]:
    """Measure every figure of the module docstring; returns the JSON document."""
    from tqdm import tqdm

    tokens, n = config.block_tokens, config.blocks
    size = geometry.block_bytes(tokens)
    half = n // 2
    rng = np.random.default_rng(20261202)
    sources = [rng.integers(0, 256, size, dtype=np.uint8).data for _ in range(n)]
    dests = [np.ones(size, dtype=np.uint8).data for _ in range(half)]  # pre-faulted
    identity = ModelIdentity(model=geometry.name, kv_dtype=geometry.dtype, block_tokens=tokens)
    load_before = os.getloadavg()
    seconds: Seconds = {
        k: []
        for k in (
            "memcpy",
            "l1_put",
            "memcpy_get_pair",
            "l1_get",
            "raw_write",
            "l2_write",
            "raw_read",
            "l2_read",
        )
    }
    with tqdm(
        total=2 * config.repeats + 1,
        desc="bench store",
        unit="pass",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        fill_s = _measure_l1(config, geometry, identity, sources, dests, seconds, bar.update)
        # A Valkey target holds the tier's and the raw copy of every block at once: room for
        # both with headroom, so the server never evicts mid-pass.
        maxmemory = 3 * n * (size + HEADER_BYTES) + 256 * 1024**2
        with l2_target(config.l2_spec, valkey_maxmemory_bytes=maxmemory) as target:
            _measure_l2(config, geometry, identity, target, sources, seconds, bar.update)

    moved = {
        name: (half if name in ("memcpy_get_pair", "l1_get") else n) * size for name in seconds
    }
    return {
        **_figures({k: [t[0] for t in v] for k, v in seconds.items()}, moved),
        "l1_put_fill_gbps": round(n * size / fill_s / 1e9, 3),
        "cpu": _figures({k: [t[1] for t in v] for k, v in seconds.items()}, moved),
        "target_ratio": TARGET_RATIO,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "cpus": os.cpu_count(),
        "block_bytes": size,
        "block_tokens": tokens,
        "blocks_per_pass": n,
        "repeats": config.repeats,
        "page_cache": "cold" if config.cold else "warm",
        "l2": config.l2_spec,
        "geometry": asdict(geometry),
    }


# ---- CLI ---------------------------------------------------------------------------------------


def _l2_spec(value: str) -> str:
    try:
        kind, where = parse_l2_spec(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if kind == "posix" and not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"{where!r} is not a directory")
    return value


def _cmd(args: argparse.Namespace) -> int:
    config = StoreBenchConfig(
        block_tokens=args.block_tokens,
        blocks=args.blocks,
        repeats=args.repeats,
        l2=args.l2,
        cold=args.cold,
    )
    result = run(config, geometry_of(args.model), progress=not args.quiet)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    cpu = result["cpu"]
    print(f"{'':>20}  {'wall':>8}  {'cpu':>8}")
    rows = [
        k
        for k, v in result.items()
        if k.endswith(("_gbps", "_ratio")) and isinstance(v, float) and k != "target_ratio"
    ]
    for key in rows:
        cpu_value = f"{cpu[key]:8.3f}" if key in cpu else f"{'-':>8}"
        print(f"{key:>20}  {result[key]:8.3f}  {cpu_value}")
    print(
        f"{'meets_target':>20}  {result['meets_target']!s:>8}  {cpu['meets_target']!s:>8}"
        f"  (every ratio >= {TARGET_RATIO})"
    )
    print(
        f"{'load_average':>20}  {result['load_average']} on {result['cpus']} CPUs "
        "(before: 1/5/15 min, after: 1/5/15 min)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    defaults = StoreBenchConfig()
    p = subparsers.add_parser(
        "store",
        help="L1/L2 block throughput next to memcpy and plain file I/O (or SET/GET)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", help="write all figures as JSON to FILE")
    p.add_argument(
        "--l2",
        metavar="posix:PATH|juicefs|valkey",
        type=_l2_spec,
        default=None,
        help="L2 target: a fresh subdirectory of PATH (default: under the temp "
        "directory), a fresh JuiceFS volume mounted twice (write through one "
        "mount, read through the other), or a fresh loopback Valkey server",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=defaults.block_tokens,
        help=f"tokens per block (default {defaults.block_tokens})",
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=defaults.blocks,
        help=f"distinct blocks per pass, a multiple of {CHAIN_BLOCKS} (default {defaults.blocks})",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help=f"timed passes per figure; medians are reported (default {defaults.repeats})",
    )
    p.add_argument(
        "--cold", action="store_true", help="drop the page cache before every read pass (root only)"
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="take the KV geometry from this HF model directory "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd)
