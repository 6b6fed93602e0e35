"""The connector's data path through TieredStore: `load_into` with a staging buffer (L2 hits read
into the caller's reused buffer, not promoted), `has_near`, adopted saves, and the writers' CPU
accounting and placement hook. Real L1, real L2 directory."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import ModelIdentity, block_hashes, root_hash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import LoadedBlock, TieredStore
from kvtier.core.tiers.base import ReadTimes, Tier
from kvtier.core.tiers.posix import OpenedBlock, PosixTier
from tests.helpers.tiers import payload_for

IDENTITY = ModelIdentity(model="store-load-into-test", block_tokens=4)
NBYTES = 64 * 1024
CHAIN = block_hashes(list(range(16)), 4)  # 4 chained blocks
T = TypeVar("T")


def meta(i: int) -> BlockMeta:
    return BlockMeta(
        num_tokens=4, dtype="uint8", shape=(NBYTES,), parent=CHAIN[i - 1] if i else root_hash()
    )


def payload(i: int) -> bytes:
    return payload_for(CHAIN[i], NBYTES)


def settings(l2: Path, **kw: object) -> StoreSettings:
    return StoreSettings(**({"l1_bytes": 8 * NBYTES, "l2_path": str(l2)} | kw))


def written(l2: Path, n: int) -> None:
    """Blocks 0..n-1 in the L2 directory, as another replica leaves them."""
    with TieredStore(settings(l2, l1_bytes=0), IDENTITY) as writer:
        for i in range(n):
            assert writer.save(CHAIN[i], meta(i), payload(i))
        assert writer.flush(60)


class Consumer:
    """What the connector's loader does with each block: copy it out before returning."""

    def __init__(self, *staging: memoryview) -> None:
        self.staging = {id(s.obj) for s in staging}
        self.got: list[tuple[Tier, bytes, bool]] = []

    def __call__(self, block: LoadedBlock) -> None:
        in_staging = id(block.payload.obj) in self.staging
        self.got.append((block.tier, bytes(block.payload), in_staging))


def test_l2_hits_are_read_into_the_staging_buffer_and_left_out_of_l1(tmp_path: Path) -> None:
    written(tmp_path, 3)
    staging = memoryview(bytearray(NBYTES))
    times = ReadTimes()
    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        assert reader.save(CHAIN[0], meta(0), payload(0))  # block 0 is in this replica's L1
        consume = Consumer(staging)
        assert reader.load_into(CHAIN, consume, staging=[staging], times=times) == 3
        assert consume.got == [
            (Tier.L1, payload(0), False),
            (Tier.L2, payload(1), True),
            (Tier.L2, payload(2), True),
        ]
        assert reader.lookup(CHAIN) == [Tier.L1, Tier.L2, Tier.L2]  # no promotion
        stats = reader.stats()
        assert stats.l2 is not None and (stats.l2.hits, stats.l2.bytes_read) == (2, 2 * NBYTES)
    assert times.open_s > 0 and times.read_s > 0 and times.checksum_s > 0


def test_reads_run_ahead_on_a_pool_and_stop_cleanly_at_a_bad_block(tmp_path: Path) -> None:
    written(tmp_path, 4)
    path = Path(PosixTier(str(tmp_path), IDENTITY.namespace(), {}).path(CHAIN[2]))
    path.write_bytes(path.read_bytes()[:-1])  # truncated: invalid
    buffers = [memoryview(bytearray(NBYTES)) for _ in range(3)]
    times = ReadTimes()
    with ThreadPoolExecutor(2) as pool, TieredStore(settings(tmp_path), IDENTITY) as reader:
        consume = Consumer(*buffers)
        assert reader.load_into(CHAIN, consume, staging=buffers, pool=pool, times=times) == 2
        assert consume.got == [(Tier.L2, payload(i), True) for i in range(2)]
        snapshot = [bytes(b) for b in buffers]
        time.sleep(0.1)
        assert [bytes(b) for b in buffers] == snapshot  # nothing still writing into them
    assert times.read_s > 0
    assert not path.exists()


class OpensAtOnce(Executor):
    """A pool that runs every job as it is submitted: all files are opened before the first
    result is looked at."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        done: Future[T] = Future()
        done.set_result(fn(*args, **kwargs))
        return done


@pytest.mark.parametrize("pool", [None, OpensAtOnce()])
def test_opened_pieces_stop_at_the_first_miss_and_leave_no_file_open(
    tmp_path: Path, pool: Executor | None
) -> None:
    """`open_pieces`: L1 hits as L1's views, L2 hits opened (with a pool, all at once), up to
    the first missing block; files opened past it are closed again, and the opened ones read
    in pieces give the blocks' bytes."""
    written(tmp_path, 4)
    Path(PosixTier(str(tmp_path), IDENTITY.namespace(), {}).path(CHAIN[2])).unlink()
    fds = len(os.listdir("/proc/self/fd"))
    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        reader.save(CHAIN[0], meta(0), payload(0))  # (an L1 hit)
        times = ReadTimes()
        opened = reader.open_pieces(CHAIN, NBYTES, pool=pool, times=times)
        assert [type(b) for b in opened] == [LoadedBlock, OpenedBlock]
        block = opened[1]
        assert isinstance(block, OpenedBlock)
        piece = memoryview(bytearray(NBYTES))
        block.read_at(0, piece)
        assert block.finish() and bytes(piece) == payload(1) and block.meta == meta(1)
        assert times.open_s > 0
        assert len(os.listdir("/proc/self/fd")) == fds  # block 3's file, if opened, closed


@pytest.mark.parametrize("pool", [None, OpensAtOnce()])
def test_read_ahead_asks_l1_once_per_block(tmp_path: Path, pool: Executor | None) -> None:
    """Blocks waiting for a free staging buffer are not looked up in L1 again: each block of
    the load counts one L1 miss, whatever the number of buffers."""
    written(tmp_path, 4)
    staging = memoryview(bytearray(NBYTES))
    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        consume = Consumer(staging)
        assert reader.load_into(CHAIN, consume, staging=[staging], pool=pool) == 4
        assert [g[1] for g in consume.got] == [payload(i) for i in range(4)]
        stats = reader.stats()
        assert stats.l1 is not None and (stats.l1.hits, stats.l1.misses) == (0, 4)


def test_without_staging_l2_hits_are_promoted_as_load_does(tmp_path: Path) -> None:
    written(tmp_path, 2)
    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        got: list[LoadedBlock] = []
        assert reader.load_into(CHAIN, got.append) == 2
        assert [bytes(b.payload) for b in got] == [payload(0), payload(1)]
        assert reader.lookup(CHAIN) == [Tier.L1, Tier.L1]


def test_a_corrupt_block_stops_the_load_and_is_removed(tmp_path: Path) -> None:
    written(tmp_path, 3)
    path = Path(PosixTier(str(tmp_path), IDENTITY.namespace(), {}).path(CHAIN[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    staging = memoryview(bytearray(NBYTES))
    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        consume = Consumer(staging)
        assert reader.load_into(CHAIN, consume, staging=[staging]) == 1
        assert [g[1] for g in consume.got] == [payload(0)]
        stats = reader.stats()
        assert stats.l2 is not None and stats.l2.corrupt_removed == 1
    assert not path.exists()


def test_a_staging_buffer_of_another_size_is_a_miss_that_leaves_the_block(tmp_path: Path) -> None:
    written(tmp_path, 1)
    staging = memoryview(bytearray(NBYTES // 2))
    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        assert reader.load_into(CHAIN, Consumer(staging), staging=[staging]) == 0
        stats = reader.stats()
        assert stats.l2 is not None and stats.l2.corrupt_removed == 0
        assert reader.lookup(CHAIN[:1]) == [Tier.L2]


def test_what_consume_raises_reaches_the_caller(tmp_path: Path) -> None:
    written(tmp_path, 2)
    staging = memoryview(bytearray(NBYTES))

    def refuse(block: LoadedBlock) -> None:
        raise ValueError("layout")

    with TieredStore(settings(tmp_path), IDENTITY) as reader:
        with pytest.raises(ValueError, match="layout"):
            reader.load_into(CHAIN, refuse, staging=[staging])


def test_has_near_asks_l1_when_it_is_on_and_l2_otherwise(tmp_path: Path) -> None:
    written(tmp_path, 1)
    with TieredStore(settings(tmp_path), IDENTITY) as with_l1:
        assert not with_l1.has_near(CHAIN[0])  # only in L2: saving it again promotes it
        assert with_l1.save(CHAIN[0], meta(0), payload(0))
        assert with_l1.has_near(CHAIN[0])
    with TieredStore(settings(tmp_path, l1_bytes=0), IDENTITY) as l2_only:
        assert l2_only.has_near(CHAIN[0]) and not l2_only.has_near(CHAIN[1])


def test_an_adopted_payload_is_kept_without_a_copy_and_written_through(tmp_path: Path) -> None:
    buffer = np.frombuffer(payload(0), dtype=np.uint8).copy()
    with TieredStore(settings(tmp_path), IDENTITY) as store:
        assert store.save(CHAIN[0], meta(0), buffer.data, adopt=True)
        (held,) = store.load(CHAIN[:1])
        assert held.tier == Tier.L1 and held.payload.readonly
        assert np.shares_memory(np.frombuffer(held.payload, dtype=np.uint8), buffer)
        assert store.flush(60)
    with TieredStore(settings(tmp_path, l1_bytes=0), IDENTITY) as other:
        assert [bytes(b.payload) for b in other.load(CHAIN[:1])] == [payload(0)]


def test_writer_threads_run_the_init_hook_and_count_their_cpu(tmp_path: Path) -> None:
    started: list[str] = []
    lock = threading.Lock()

    def init() -> None:
        with lock:
            started.append(threading.current_thread().name)

    with TieredStore(settings(tmp_path, io_threads=2), IDENTITY, thread_init=init) as store:
        for i in range(3):
            assert store.save(CHAIN[i], meta(i), payload(i))
        assert store.flush(60)
        assert store.stats().l2_write_cpu_seconds > 0
    assert sorted(started) == ["kvtier-l2-writer-0", "kvtier-l2-writer-1"]
