"""Distributed L2 targets for the store benchmark, and their raw baselines.

`kvtier bench store --l2 posix:PATH|juicefs|valkey` needs (a) something to benchmark against,
started and torn down around the run, and (b) the raw operation the tier wraps, on the same
target and the same bytes:

    posix:PATH  the directory as is; raw = open/write/close and open/read of plain files.
    juicefs     a fresh JuiceFS volume (Valkey metadata, local object dir) mounted twice:
                writes go through mount A, reads through mount B (another "node", so reads
                really cross the FUSE daemons, not one page cache); raw = the same plain-file
                I/O, written through A and read through B.
    valkey      a fresh loopback Valkey server (maxmemory sized to the run, allkeys-lru);
                raw = SET and GET of the same bytes, one key per block.

    with l2_target("juicefs") as target:
        tier = target.open_tier(identity)            # writer side
        reader = target.open_tier(identity, reader=True)
        target.raw_write(names, payloads); target.raw_read(names); target.raw_clear(names)

`measure(...)` runs tier and raw side by side (alternating which goes first) and returns medians
and ratios; `python -m kvtier.bench.l2 --l2 juicefs --json FILE` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np
import valkey

from kvtier.codec import HEADER_BYTES, BlockMeta
from kvtier.keys import BlockHash, ModelIdentity, block_hashes, extra_key, root_hash
from kvtier.tiers.base import BlockTier

_RAW_PREFIX = "kvtier-bench-raw:"


@dataclass(slots=True)
class L2Target:
    """A running L2 to benchmark; see the module docstring."""

    kind: str
    """"posix", "juicefs" or "valkey"."""
    write_root: str | None = None
    """Directory the writer side uses (posix, juicefs)."""
    read_root: str | None = None
    """The same directory as another node sees it (juicefs: the second mount)."""
    url: str | None = None
    """Valkey URL (valkey)."""
    _client: valkey.Valkey | None = field(default=None, repr=False)

    def open_tier(self, identity: ModelIdentity, *, reader: bool = False) -> BlockTier:
        """The kvtier L2 tier on this target (the reader side reads through the other mount)."""
        if self.url is not None:
            from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig
            return ValkeyTier(ValkeyTierConfig(self.url, socket_timeout_s=30.0),
                              identity.namespace(), identity.manifest())
        from kvtier.tiers.posix import PosixTier
        root = self.read_root if reader else self.write_root
        assert root is not None
        return PosixTier(root, identity.namespace(), identity.manifest(), exists_ttl_s=0)

    def _raw_path(self, name: str, reader: bool) -> str:
        root = self.read_root if reader else self.write_root
        assert root is not None
        return os.path.join(root, "raw", name)

    def _valkey(self) -> valkey.Valkey:
        if self._client is None:
            assert self.url is not None
            self._client = valkey.Valkey.from_url(self.url, socket_timeout=30.0)
        return self._client

    def raw_write(self, names: Sequence[str], sources: Sequence[memoryview]) -> None:
        """The plain operation a tier put wraps, on the same bytes."""
        if self.url is not None:
            client = self._valkey()
            for name, src in zip(names, sources, strict=True):
                client.set(_RAW_PREFIX + name, src)
            return
        os.makedirs(self._raw_path("", False), exist_ok=True)
        for name, src in zip(names, sources, strict=True):
            with open(self._raw_path(name, False), "wb", buffering=0) as f:
                f.write(src)

    def raw_read(self, names: Sequence[str]) -> int:
        """The plain operation a tier get wraps (reader side); bytes read."""
        total = 0
        if self.url is not None:
            client = self._valkey()
            for name in names:
                total += len(cast("bytes | None", client.get(_RAW_PREFIX + name)) or b"")
            return total
        for name in names:
            with open(self._raw_path(name, True), "rb", buffering=0) as f:
                total += len(f.read())
        return total

    def raw_clear(self, names: Sequence[str]) -> None:
        if self.url is not None:
            if names:
                self._valkey().delete(*[_RAW_PREFIX + n for n in names])
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._raw_path(name, False))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()  # type: ignore[no-untyped-call]
            self._client = None


@contextlib.contextmanager
def l2_target(spec: str, *, workdir: str | None = None,
              valkey_maxmemory_bytes: int = 2 * 1024**3) -> Iterator[L2Target]:
    """Start (and afterwards stop) the L2 named by `spec`: posix:PATH, juicefs or valkey."""
    kind, _, where = spec.partition(":")
    if kind == "posix" and where:
        target = L2Target("posix", write_root=where, read_root=where)
        try:
            yield target
        finally:
            target.close()
        return
    from kvtier.l2.valkey_server import ValkeyServerSpec, start_valkey
    if kind not in ("juicefs", "valkey") or where:
        raise ValueError(f"l2: expected posix:PATH, juicefs or valkey, got {spec!r}")
    scratch = tempfile.mkdtemp(prefix=f"kvtier-bench-{kind}-", dir=workdir)
    server = start_valkey(ValkeyServerSpec(
        maxmemory_bytes=valkey_maxmemory_bytes if kind == "valkey" else 256 * 1024**2))
    try:
        if kind == "valkey":
            target = L2Target("valkey", url=server.url)
            try:
                yield target
            finally:
                target.close()
            return
        from kvtier.l2.juicefs import JuiceFSVolume, JuiceFSVolumeSpec
        with JuiceFSVolume(JuiceFSVolumeSpec(root=scratch, meta_url=server.url + "/1")) as vol:
            a, b = vol.mount(), vol.mount()
            target = L2Target("juicefs", write_root=a.path, read_root=b.path)
            try:
                yield target
            finally:
                target.close()
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def _blocks(tag: str, n: int, tokens: int, nbytes: int) -> tuple[list[BlockHash],
                                                                  list[BlockMeta]]:
    extra = extra_key(cache_salt=tag)
    hashes = block_hashes([3] * (tokens * n), tokens, extra)
    metas = [BlockMeta(num_tokens=tokens, dtype="uint8", shape=(nbytes,),
                       parent=hashes[i - 1] if i else root_hash(extra)) for i in range(n)]
    return hashes, metas


def _put_all(tier: BlockTier, hashes: Sequence[BlockHash], metas: Sequence[BlockMeta],
             sources: Sequence[memoryview]) -> None:
    for h, m, s in zip(hashes, metas, sources, strict=True):
        tier.put(h, m, s)


def _get_all(tier: BlockTier, hashes: Sequence[BlockHash]) -> None:
    for h in hashes:
        tier.get(h)


def measure(target: L2Target, *, block_bytes: int = 5_898_240, blocks: int = 16,
            repeats: int = 3, tokens: int = 256) -> dict[str, Any]:
    """Tier put/get next to raw write/read of the same bytes on `target`; GB/s medians."""
    identity = ModelIdentity(model=f"kvtier-bench-l2-{time.time_ns()}", block_tokens=tokens)
    writer, reader = target.open_tier(identity), target.open_tier(identity, reader=True)
    rng = np.random.default_rng(20261202)
    sources = [rng.integers(0, 256, block_bytes, dtype=np.uint8).data for _ in range(blocks)]
    times: dict[str, list[float]] = {"l2_write": [], "raw_write": [], "l2_read": [],
                                     "raw_read": []}
    for r in range(repeats):
        hashes, metas = _blocks(f"{identity.model}/{r}", blocks, tokens, block_bytes)
        names = [f"{r}-{i}" for i in range(blocks)]
        ops: dict[str, Callable[[], object]] = {
            "l2_write": partial(_put_all, writer, hashes, metas, sources),
            "raw_write": partial(target.raw_write, names, sources),
            "l2_read": partial(_get_all, reader, hashes),
            "raw_read": partial(target.raw_read, names),
        }
        order = [("l2_write", "raw_write"), ("l2_read", "raw_read")]
        for pair in order:
            for name in (pair if r % 2 == 0 else pair[::-1]):
                if name.endswith("read") and target.kind == "juicefs":
                    time.sleep(1.2)  # let the other mount's attribute cache see new files
                start = time.perf_counter()
                ops[name]()
                times[name].append(time.perf_counter() - start)
        for h in hashes:
            writer.remove(h)
        target.raw_clear(names)
    hits = reader.stats().hits
    for tier in (writer, reader):
        tier.close()
    if hits != blocks * repeats:
        raise RuntimeError(f"L2 read back {hits} of {blocks * repeats} blocks")
    gbps = {k: [round(blocks * block_bytes / t / 1e9, 3) for t in v] for k, v in times.items()}
    med = {f"{k}_gbps": statistics.median(v) for k, v in gbps.items()}
    return {
        **med,
        "l2_write_ratio": round(med["l2_write_gbps"] / med["raw_write_gbps"], 3),
        "l2_read_ratio": round(med["l2_read_gbps"] / med["raw_read_gbps"], 3),
        "target": target.kind, "block_bytes": block_bytes, "object_bytes":
        block_bytes + HEADER_BYTES, "blocks_per_pass": blocks, "repeats": repeats,
        "per_repeat_gbps": gbps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.l2", description=__doc__)
    parser.add_argument("--l2", default="juicefs", help="posix:PATH, juicefs or valkey")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-bytes", type=int, default=5_898_240)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    with l2_target(args.l2) as target:
        result = measure(target, block_bytes=args.block_bytes, blocks=args.blocks,
                         repeats=args.repeats)
    result["command"] = " ".join(["python -m kvtier.bench.l2", *(argv or sys.argv[1:])])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "per_repeat_gbps"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
