"""`read_ahead`: a chain of blocks handed to a consumer in order, L2 reads running ahead of it.

Used by `TieredStore.load_into` (the connector's load path). Blocks held locally (L1) are handed
out as they are; the others are read from L2 into a ring of caller-owned staging buffers, up to
one read per buffer in flight on the caller's `pool`, so the reads of the next blocks (open,
read, checksum) overlap each other and the consumer's copy of the current one. Over a FUSE
mount, where one read waits on the daemon most of the time, that multiplies the throughput; on
a local page cache it overlaps the checksum and the copy.

The consumer sees blocks strictly in chain order and each staging buffer only until it returns;
the first block that cannot be read ends the chain (reads already in flight after it are
cancelled or waited for, never left writing into a buffer the caller reuses). Without a pool,
every read runs on the caller's thread when its turn comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import ReadTimes, StoredBlock

__all__ = ["Staged", "read_ahead"]

ReadInto = Callable[[BlockHash, memoryview, ReadTimes], BlockMeta | None]


@dataclass(frozen=True, slots=True)
class Staged:
    """One block as `read_ahead` hands it out: held locally (`local`) or read into `buffer`."""

    block_hash: BlockHash
    meta: BlockMeta
    payload: memoryview
    local: bool


@dataclass(slots=True)
class _Pending:
    block_hash: BlockHash
    local: StoredBlock | None = None
    buffer: memoryview | None = None
    read: Future[BlockMeta | None] | None = None
    times: ReadTimes | None = None


def _now(value: BlockMeta | None) -> Future[BlockMeta | None]:
    done: Future[BlockMeta | None] = Future()
    done.set_result(value)
    return done


def read_ahead(
    hashes: Sequence[BlockHash],
    *,
    local: Callable[[BlockHash], StoredBlock | None],
    read: ReadInto,
    consume: Callable[[Staged], None],
    buffers: Sequence[memoryview],
    pool: Executor | None = None,
    times: ReadTimes | None = None,
) -> int:
    """Hand the leading readable blocks of `hashes` to `consume`, in order; returns how many.

    `local(h)` is the block held locally or None; `read(h, buffer, times)` reads the payload into
    `buffer` (the meta, or None on a miss) and runs on `pool` when one is given. `times`
    accumulates every read's phases (thread-seconds: parallel reads may add up to more than the
    wall time). Whatever `consume` raises propagates, after the reads in flight are settled.
    """
    if not buffers:
        raise ValueError("buffers: at least one staging buffer is needed")
    free = list(buffers)
    queue: deque[_Pending] = deque()
    next_index = 0
    done = 0

    def fill() -> None:
        nonlocal next_index
        # Only with a buffer free: a block looked up and then left waiting for one would be
        # looked up again (an L1 miss counted twice).
        while next_index < len(hashes) and free:
            h = hashes[next_index]
            held = local(h)
            if held is not None:
                queue.append(_Pending(h, local=held))
            else:
                buffer, t = free.pop(), ReadTimes()
                job = pool.submit(read, h, buffer, t) if pool is not None else None
                queue.append(_Pending(h, buffer=buffer, read=job, times=t))
            next_index += 1

    try:
        while True:
            fill()
            if not queue:
                return done
            item = queue.popleft()
            if item.local is not None:
                consume(Staged(item.block_hash, item.local.meta, item.local.payload, True))
            else:
                assert item.buffer is not None and item.times is not None
                job = item.read or _now(read(item.block_hash, item.buffer, item.times))
                meta = job.result()
                if times is not None:
                    times.add(item.times)
                if meta is None:
                    return done
                consume(Staged(item.block_hash, meta, item.buffer, False))
                free.append(item.buffer)
            done += 1
    finally:
        in_flight = [p.read for p in queue if p.read is not None and not p.read.cancel()]
        wait(in_flight)
