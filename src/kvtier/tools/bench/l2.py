"""L2 targets of `kvtier bench store --l2 posix:PATH|juicefs|valkey|valkey-aof|valkey-cluster`,
with their raw baselines.

A target is an L2 to benchmark, started before the run and torn down after it, together with
the raw operation the tier wraps, on the same target and the same bytes:

    posix:PATH  a fresh subdirectory of PATH, removed afterwards; raw = open/write/close and
                open/read of plain files in it.
    juicefs     a fresh JuiceFS volume (Valkey metadata, objects in a local directory) mounted
                twice: writes go through mount A, reads through mount B (another "node", so
                reads really cross the FUSE daemons, not one page cache); raw = the same
                plain-file I/O, written through A and read through B.
    valkey      a fresh loopback Valkey server (allkeys-lru, maxmemory sized by the caller);
                raw = SET and GET of the same bytes, one key per block.
    valkey-aof  the same with an append-only file synced every second, as `l2CachePersistent`
                runs it (in the temp directory or `workdir`): what persistence costs.
    valkey-cluster
                a fresh loopback Valkey cluster of three shards (`CLUSTER_SHARDS`, the memory
                split between them); raw = SET and GET sent to the shard holding the key.

    with l2_target("juicefs") as target:
        writer, reader = target.open_tier(identity), target.open_tier(identity, reader=True)
        target.raw_write(name, payload)
        target.settle()                   # until the reader side sees what was written
        target.raw_read(name)

The measuring loop is `kvtier.tools.bench.store`'s, the same for every target.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from valkey.connection import PythonRespSerializer

from kvtier.core.codec import byte_view
from kvtier.core.errors import ConfigError
from kvtier.core.keys import ModelIdentity
from kvtier.core.tiers.base import BlockTier
from kvtier.core.tiers.valkey_shards import Shards, open_shards


def _encode(arg: object) -> bytes | memoryview:
    """A command argument as valkey-py's encoder makes it: a buffer as bytes (its packer counts
    `len()`), text and numbers as UTF-8; anything else is refused."""
    if isinstance(arg, bytes | bytearray | memoryview):
        return byte_view(arg)
    if isinstance(arg, str | int | float):
        return str(arg).encode()
    raise TypeError(f"a Valkey command argument of type {type(arg).__name__}")


KINDS = ("posix", "juicefs", "valkey", "valkey-aof", "valkey-cluster")
CLUSTER_SHARDS = 3
_RAW_PREFIX = "kvtier-bench-raw:"
_RAW_DIR = "raw"


def parse_l2_spec(spec: str) -> tuple[str, str]:
    """(kind, path) of `posix:PATH` or one of the other `KINDS` (path empty but for posix)."""
    kind, _, where = spec.partition(":")
    if kind not in KINDS or (kind == "posix") != bool(where):
        raise ConfigError(
            f"l2: expected posix:PATH, juicefs, valkey, valkey-aof or valkey-cluster, got {spec!r}"
        )
    return kind, where


@dataclass(slots=True)
class L2Target:
    """A running L2 to benchmark; see the module docstring."""

    kind: str
    """One of `KINDS`."""
    write_root: str | None = None
    """Directory the writer side uses (posix, juicefs)."""
    read_root: str | None = None
    """The same directory as another node sees it (juicefs: the second mount)."""
    url: str | None = None
    """Valkey URL (valkey)."""
    settle_s: float = 0.0
    """How long a file written on one side may stay invisible on the other (attribute cache)."""
    _shards: Shards | None = field(default=None, repr=False)

    def open_tier(self, identity: ModelIdentity, *, reader: bool = False) -> BlockTier:
        """The kvtier L2 tier on this target (the reader side reads through the other mount)."""
        if self.url is not None:
            from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings

            return ValkeyTier(
                ValkeyTierSettings(url=self.url, socket_timeout_s=30.0),
                identity.namespace(),
                identity.manifest(),
            )
        from kvtier.core.tiers.posix import PosixTier

        return PosixTier(
            self._root(reader), identity.namespace(), identity.manifest(), exists_ttl_s=0
        )

    def _root(self, reader: bool) -> str:
        root = self.read_root if reader else self.write_root
        assert root is not None, "a directory target has both roots"
        return root

    def _raw_path(self, name: str, reader: bool) -> str:
        return os.path.join(self._root(reader), _RAW_DIR, name)

    def _valkey(self) -> Shards:
        """Clients of the server, or of each shard of the cluster (a key sent to its own)."""
        if self._shards is None:
            assert self.url is not None
            # valkey-py packs commands with libvalkey when installed, which copies a large
            # value into one buffer first; its Python packer sends it as it is, the faster plain SET
            packer = PythonRespSerializer(6000, _encode)
            (self._shards,) = open_shards(self.url, {"command_packer": packer}, [30.0])
        return self._shards

    def raw_write(self, name: str, source: memoryview) -> None:
        """The plain operation a tier put wraps, on the same bytes (writer side)."""
        if self.url is not None:
            key = _RAW_PREFIX + name
            self._valkey().one(key, lambda client: client.set(key, source))
            return
        with open(self._raw_path(name, False), "wb", buffering=0) as f:
            f.write(source)

    def raw_read(self, name: str) -> int:
        """The plain operation a tier get wraps, into a fresh buffer (reader side); bytes read."""
        if self.url is not None:
            key = _RAW_PREFIX + name
            return len(cast("bytes | None", self._valkey().one(key, lambda c: c.get(key))) or b"")
        with open(self._raw_path(name, True), "rb", buffering=0) as f:
            return len(f.read())

    def raw_read_many(self, names: Sequence[str]) -> int:
        """The plain batch read a tier `get_many` wraps (Valkey targets): one pipeline of GETs
        (per shard); bytes read."""
        keys = [_RAW_PREFIX + name for name in names]
        values = self._valkey().each(keys, lambda pipe, key: pipe.get(key))
        return sum(len(value or b"") for value in values)

    def raw_read_into(self, name: str, buffer: memoryview) -> int:
        """The plain read into a buffer the reader reuses (directory targets); bytes read."""
        with open(self._raw_path(name, True), "rb", buffering=0) as f:
            return f.readinto(buffer) or 0

    def raw_remove(self, name: str) -> None:
        if self.url is not None:
            key = _RAW_PREFIX + name
            self._valkey().one(key, lambda client: client.delete(key))
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._raw_path(name, False))

    def settle(self) -> None:
        """Wait until the reader side sees what the writer side just wrote."""
        if self.settle_s:
            time.sleep(self.settle_s)

    def close(self) -> None:
        if self._shards is not None:
            self._shards.close()
            self._shards = None


@contextlib.contextmanager
def _opened(target: L2Target) -> Iterator[L2Target]:
    if target.write_root is not None:
        os.makedirs(os.path.join(target.write_root, _RAW_DIR), exist_ok=True)
    try:
        yield target
    finally:
        target.close()


@contextlib.contextmanager
def l2_target(
    spec: str, *, workdir: str | None = None, valkey_maxmemory_bytes: int = 2 * 1024**3
) -> Iterator[L2Target]:
    """Start (and afterwards stop and remove) the L2 named by `spec` (see the module docstring).

    `workdir` holds a JuiceFS volume's objects, caches and mount points (default: /tmp).
    """
    kind, where = parse_l2_spec(spec)
    scratch = tempfile.mkdtemp(prefix=f"kvtier-bench-{kind}-", dir=where or workdir)
    try:
        if kind == "posix":
            with _opened(L2Target("posix", write_root=scratch, read_root=scratch)) as target:
                yield target
            return
        from kvtier.tools.l2ops.valkey_server import (
            PERSISTENT_L2_APPENDFSYNC,
            ValkeyServerSpec,
            start_valkey,
        )

        if kind == "valkey-cluster":
            from kvtier.tools.l2ops.valkey_cluster import valkey_cluster

            node_spec = ValkeyServerSpec(
                maxmemory_bytes=valkey_maxmemory_bytes // CLUSTER_SHARDS,
                data_dir=os.path.join(scratch, "valkey"),
            )
            with valkey_cluster(CLUSTER_SHARDS, node_spec) as nodes:
                with _opened(L2Target(kind, url=nodes[0].url)) as target:
                    yield target
            return
        l2_on_valkey = kind != "juicefs"
        with start_valkey(
            ValkeyServerSpec(
                maxmemory_bytes=valkey_maxmemory_bytes if l2_on_valkey else 256 * 1024**2,
                data_dir=os.path.join(scratch, "valkey"),
                appendfsync=PERSISTENT_L2_APPENDFSYNC if kind == "valkey-aof" else None,
            )
        ) as server:
            if l2_on_valkey:
                with _opened(L2Target(kind, url=server.url)) as target:
                    yield target
                return
            from kvtier.tools.l2ops.juicefs import JuiceFSVolume, JuiceFSVolumeSpec

            volume_spec = JuiceFSVolumeSpec(
                root=os.path.join(scratch, "juicefs"), meta_url=server.url + "/1"
            )
            with JuiceFSVolume(volume_spec) as volume:
                a, b = volume.mount(), volume.mount()
                with _opened(
                    L2Target(
                        "juicefs",
                        write_root=a.path,
                        read_root=b.path,
                        settle_s=volume_spec.attr_cache_s + 0.2,
                    )
                ) as target:
                    yield target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
