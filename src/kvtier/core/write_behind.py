"""`WriteBehind`: the store's asynchronous write-through to L2, bounded and never blocking.

    offer(h, meta, payload)   caller's thread (the connector's saver): queue one block for L2.
                              Returns at once. Skipped when the block is already queued or a
                              writer confirmed it in L2 within `confirm_ttl_s`; dropped and
                              counted when the queue is full or `close` has begun: a save
                              never waits for L2.
    flush(timeout_s)          owner: wait until nothing is queued or being written.
    close(drain, timeout_s)   owner: finish (drain) or abandon what is queued, stop the writers.

`threads` writer threads (daemons, owned here; `thread_init` runs first in each) take jobs off
the queue and `put` them into the tier. Each result goes to `on_written(result, h)` (on the
writer's thread; it must not block), and a block the tier stored or already held is remembered
as confirmed. Tier faults never escape: a `put` that raises is logged and counted in
`write_errors`. The CPU time the writers spend in `put` is counted (`cpu_seconds`): with a
file system L2 it is the checksum and the copy into the page cache, work that runs beside the
engine on the replica's CPUs.

The payload must stay unchanged until written: the store hands over L1's immutable copy, or a
private copy when L1 is off.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.clock import deadline_in, seconds_left
from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash
from kvtier.core.lru import Lru
from kvtier.core.tiers.base import BlockTier, PutResult

__all__ = ["WriteBehind"]

log = logging.getLogger(__name__)

CONFIRMED_MAX = 1 << 16
"""Recent L2 confirmations remembered (least recent forgotten first)."""


@dataclass(frozen=True, slots=True)
class _Job:
    block_hash: BlockHash
    meta: BlockMeta
    payload: memoryview


class WriteBehind:
    """A bounded queue of L2 writes and the threads that perform them."""

    def __init__(
        self,
        tier: BlockTier,
        *,
        queue_blocks: int,
        threads: int,
        confirm_ttl_s: float,
        on_written: Callable[[PutResult, BlockHash], None],
        clock: Callable[[], float] = time.monotonic,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        self._tier = tier
        self._confirm_ttl_s = confirm_ttl_s
        self._on_written = on_written
        self._clock = clock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # All guarded by _lock: queued or being written; recently confirmed in L2, with when.
        self._pending: set[BlockHash] = set()
        self._confirmed: Lru[BlockHash, float] = Lru(CONFIRMED_MAX)
        self._counts = dict.fromkeys(("queued", "dropped", "abandoned", "write_errors"), 0)
        self._cpu_seconds = 0.0
        self._thread_init = thread_init
        self._abandon = False
        self._closed = False  # guarded by _lock: offers are refused from close() on
        self._queue: queue.Queue[_Job | None] = queue.Queue(queue_blocks)
        self._threads = [
            threading.Thread(target=self._write_loop, daemon=True, name=f"kvtier-l2-writer-{i}")
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def snapshot(self) -> dict[str, int]:
        """Counters: queued (jobs accepted), dropped (refused by a full queue), abandoned
        (discarded by `close`), write_errors (`put` raised), depth (queued or being written
        right now)."""
        with self._lock:
            return {**self._counts, "depth": len(self._pending)}

    def cpu_seconds(self) -> float:
        """CPU time the writers spent in `put` so far."""
        with self._lock:
            return self._cpu_seconds

    def offer(self, block_hash: BlockHash, meta: BlockMeta, payload: memoryview) -> None:
        """Queue one block for L2 (see the module docstring); after `close` began, the block is
        dropped and counted, since no writer may be left to take it."""
        with self._lock:
            if block_hash in self._pending or self._recently_confirmed(block_hash):
                return
            # Checked and queued under the lock: only offers fill the queue until close().
            if self._closed or self._queue.full():
                self._counts["dropped"] += 1
                return
            self._queue.put_nowait(_Job(block_hash, meta, payload))
            self._pending.add(block_hash)
            self._counts["queued"] += 1

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write has finished; False if `timeout_s` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout_s)

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Finish queued writes for up to `timeout_s` (`drain`), abandon the rest, and join the
        writers until `timeout_s` (counted from the call) runs out. A write in progress cannot
        be interrupted; the writers are daemons, so a hung mount cannot keep the process alive."""
        deadline = deadline_in(timeout_s)
        with self._lock:
            self._closed = True  # every job offered before is in the queue, ahead of the stops
        if not (drain and self.flush(timeout_s)):
            self._abandon = True
            self._discard_queued()
        for _ in self._threads:  # (a full queue of hung writers takes none: they are left)
            try:
                self._queue.put(None, timeout=seconds_left(deadline))
            except queue.Full:
                break
        for thread in self._threads:
            thread.join(seconds_left(deadline))

    def _recently_confirmed(self, block_hash: BlockHash) -> bool:
        """Did a writer confirm this block in L2 within the TTL? (lock held) Re-saving a hot
        prefix then costs no queue slot and no I/O; after the TTL the writer checks L2 again,
        in case the janitor removed the block meanwhile."""
        confirmed = self._confirmed.peek(block_hash)
        return confirmed is not None and self._clock() - confirmed < self._confirm_ttl_s

    def _write_loop(self) -> None:
        if self._thread_init is not None:
            try:
                self._thread_init()
            except Exception:  # placement is an optimisation: write from where we are
                log.exception("kvtier: L2 writer thread setup failed")
        while (job := self._queue.get()) is not None:
            if self._abandon:
                self._finish(job.block_hash, "abandoned")
                continue
            cpu = time.thread_time()
            try:
                result = self._tier.put(job.block_hash, job.meta, job.payload)
            except Exception:  # a tier must not raise; never let one kill the writer
                log.exception("kvtier: L2 write of %s failed", job.block_hash.hex())
                self._finish(job.block_hash, "write_errors")
                continue
            finally:
                with self._lock:
                    self._cpu_seconds += time.thread_time() - cpu
            self._on_written(result, job.block_hash)
            if result.stored or self._present(job.block_hash):
                with self._lock:
                    self._confirmed.put(job.block_hash, self._clock())
            self._finish(job.block_hash)

    def _present(self, block_hash: BlockHash) -> bool:
        try:
            return self._tier.contains(block_hash)
        except Exception:  # a misbehaving tier: just not confirmed
            log.exception("kvtier: L2 existence check of %s failed", block_hash.hex())
            return False

    def _discard_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._finish(job.block_hash, "abandoned")

    def _finish(self, block_hash: BlockHash, count: str | None = None) -> None:
        with self._idle:
            self._pending.discard(block_hash)
            if count is not None:
                self._counts[count] += 1
            if not self._pending:
                self._idle.notify_all()
