"""The POSIX L2 tier on two FUSE mounts of one JuiceFS volume: two "nodes" sharing blocks."""

from __future__ import annotations

import json
import mmap
import os
import time

import pytest

from kvtier.core.codec import HEADER_BYTES
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.posix import PosixTier
from kvtier.tools.l2ops.juicefs import JuiceFSMount, JuiceFSVolumeSpec, mounted_under
from tests.helpers.l2 import (
    IDENTITY,
    NAMESPACE,
    finish_worker,
    make_block,
    needs_fuse,
    poll,
    run_worker,
    spawn_worker,
)

pytestmark = [pytest.mark.juicefs, needs_fuse]

KIB = 1024
VISIBLE_WITHIN_S = 10.0  # bounded wait; JuiceFS attribute caches are ~1 s


def tier_on(mount: JuiceFSMount) -> PosixTier:
    return PosixTier(mount.path, NAMESPACE, IDENTITY.manifest(), exists_ttl_s=0)


def test_blocks_written_through_one_mount_are_hit_through_the_other(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    report = run_worker(
        "write", f"posix:{a.path}", "--seed", "10", "--count", "6", "--bytes", str(1024 * KIB)
    )
    assert report == {"stored": 6, "already_present": 0, "errors": 0}
    reader = tier_on(b)
    for i in range(6):
        h, meta, payload = make_block(10, i, 1024 * KIB)
        got = poll(lambda: reader.get(h), VISIBLE_WITHIN_S)  # noqa: B023 (called right here)
        assert got is not None and bytes(got.payload) == payload and got.meta == meta
    assert reader.stats().corrupt_removed == 0 and reader.stats().errors == 0


def test_a_new_process_finds_everything_already_in_l2_without_a_rebuild(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    run_worker("write", f"posix:{a.path}", "--seed", "11", "--count", "4", "--bytes", "4096")

    # Warm restart: a brand-new replica process on the other node reads them straight away.
    def read_all() -> dict[str, object] | None:
        r = run_worker("read", f"posix:{b.path}", "--seed", "11", "--count", "4", "--bytes", "4096")
        return r if r["hits"] == 4 else None

    report = poll(read_all, VISIBLE_WITHIN_S)
    assert report and report["misses"] == 0 and report["mismatched"] == 0


def test_concurrent_writers_through_both_mounts_never_produce_a_torn_read(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    common = ["--seed", "12", "--count", "12", "--bytes", str(768 * KIB)]
    readers = [
        spawn_worker("read", f"posix:{m.path}", *common, "--variants", "1,2", "--seconds", "4")
        for m in (a, b)
    ]
    writers = [
        spawn_worker("write", f"posix:{m.path}", *common, "--variant", str(v))
        for m, v in ((a, 1), (b, 2))
    ]
    written = [finish_worker(w) for w in writers]
    reads = [finish_worker(r) for r in readers]
    assert sum(int(w["stored"]) for w in written) == 12  # type: ignore[call-overload]
    assert all(w["errors"] == 0 for w in written)
    for r in reads:
        assert (r["mismatched"], r["corrupt_removed"], r["errors"]) == (0, 0, 0), r
    assert sum(int(r["hits"]) for r in reads) > 0  # type: ignore[call-overload]
    # No temp file is left behind by the losers.
    leftovers = [f for _, _, files in os.walk(a.path) for f in files if f.endswith(".tmp")]
    assert leftovers == []


def test_the_fixture_mounts_are_real_fuse_mounts(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    assert mounted_under(a.path) == [a.path] and mounted_under(b.path) == [b.path]
    assert os.stat(a.path).st_dev != os.stat(b.path).st_dev


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_direct_reads_through_the_other_mount_return_the_bytes(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
    monkeypatch: pytest.MonkeyPatch,
    offset: int,
) -> None:
    """The juicefs profile's O_DIRECT reads (no page cache) into any buffer, aligned or not; the
    payload in one read call (fewer round trips through the FUSE daemon)."""
    a, b = two_mounts
    seed = 20 + offset
    run_worker("write", f"posix:{a.path}", "--seed", str(seed), "--count", "2", "--bytes", "300000")
    flags: list[int] = []
    real_open = os.open

    def spy(path: str, how: int, *args: int) -> int:
        flags.append(how)
        return real_open(path, how, *args)

    reads: list[int] = []
    real_readv = os.readv

    def count(fd: int, buffers: list[memoryview]) -> int:
        reads.append(sum(len(b) for b in buffers))
        return real_readv(fd, buffers)

    reader = PosixTier(b.path, NAMESPACE, IDENTITY.manifest(), exists_ttl_s=0, direct_reads=True)
    monkeypatch.setattr("kvtier.core.tiers.posix.os.open", spy)
    monkeypatch.setattr("kvtier.core.tiers.posix.os.readv", count)
    h, meta, payload = make_block(seed, 0, 300000)
    assert poll(lambda: reader.contains(h) or None, VISIBLE_WITHIN_S)
    got = reader.get(h)
    assert got is not None and bytes(got.payload) == payload and got.meta == meta
    assert reads == [HEADER_BYTES, 300000]  # the header, then the payload in one call
    h, meta, payload = make_block(seed, 1, 300000)
    out = memoryview(bytearray(300000 + offset))[offset:]
    reads.clear()
    assert reader.read_into(h, out) == meta and bytes(out) == payload
    assert reads == [HEADER_BYTES, 300000]
    assert flags and all(f & os.O_DIRECT for f in flags)
    assert reader.stats().errors == 0


def test_a_mount_keeps_no_block_cache_of_its_own(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    """The volume's mounts run with no local block cache (`block_cache_mib` 0): a block read
    across mounts is not written again into the reading mount's cache directory."""
    a, b = two_mounts
    run_worker("write", f"posix:{a.path}", "--seed", "40", "--count", "1", "--bytes", "300000")
    reader = PosixTier(b.path, NAMESPACE, IDENTITY.manifest(), exists_ttl_s=0)
    h, _, payload = make_block(40, 0, 300000)
    assert poll(lambda: reader.contains(h) or None, VISIBLE_WITHIN_S)
    got = reader.get(h)
    assert got is not None and bytes(got.payload) == payload
    time.sleep(1.0)  # JuiceFS writes its cache in the background
    cache_dir = os.path.join(os.path.dirname(b.path), "cache1")
    cached = [f for _, _, files in os.walk(cache_dir) for f in files]
    assert not cached, cached


def test_a_mount_reads_ahead_nothing_by_default(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    """The daemons run with no read-ahead (`max_readahead_mib` 0: layer-by-layer reads want
    each block's first layer without a fetch ahead); the tests above read whole blocks
    through these very mounts."""
    for mount in two_mounts:  # the daemon's own view of its settings (32 MiB by default)
        with open(os.path.join(mount.path, ".config"), encoding="utf-8") as f:
            assert json.load(f)["Chunk"]["Readahead"] == 0


def test_a_whole_block_read_reaches_the_daemon_in_mebibyte_requests(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    """`max_fuse_io_kib` 1024: an O_DIRECT read of 2 MiB is two FUSE requests of 1 MiB (the
    daemon's access log shows each request's size; JuiceFS alone asks for 128 KiB ones)."""
    a, b = two_mounts
    payload = os.urandom(2048 * KIB)
    with open(os.path.join(a.path, "whole-read"), "wb") as f:
        f.write(payload)
    path = os.path.join(b.path, "whole-read")
    poll(lambda: os.path.exists(path) and os.path.getsize(path) == len(payload) or None, 10.0)
    log = os.open(os.path.join(b.path, ".accesslog"), os.O_RDONLY | os.O_NONBLOCK)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = memoryview(mmap.mmap(-1, len(payload)))  # page-aligned: no split at the start
            assert os.preadv(fd, [buf], 0) == len(payload) and buf == payload
        finally:
            os.close(fd)
        time.sleep(0.2)  # the daemon logs each request as it answers it
        lines = os.read(log, 1 << 20).decode().splitlines()
    finally:
        os.close(log)
    sizes = [int(line.split(" read (")[1].split(",")[1]) for line in lines if " read (" in line]
    assert sizes == [1024 * KIB, 1024 * KIB], lines


def test_a_negative_block_cache_read_ahead_or_fuse_request_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="block_cache_mib: must be >= 0, got -1"):
        JuiceFSVolumeSpec(root="/srv/jfs", block_cache_mib=-1)
    with pytest.raises(ConfigError, match="max_readahead_mib: must be >= 0, got -2"):
        JuiceFSVolumeSpec(root="/srv/jfs", max_readahead_mib=-2)
    with pytest.raises(ConfigError, match=r"max_fuse_io_kib: must be 4..1024 .*, got 2048"):
        JuiceFSVolumeSpec(root="/srv/jfs", max_fuse_io_kib=2048)
