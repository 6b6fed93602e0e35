"""L1: a byte-budgeted host-memory tier with LRU eviction.

Why LRU (and not S3-FIFO or ARC): the store already filters one-hit wonders before they reach
L1 (admission policies in `kvtier.core.admission`), which is most of what S3-FIFO's probationary
queue buys; what is left is a recency workload (conversations and agents coming back to their
prefix), where LRU is exact, O(1) per entry with an ordered dict, and easy to reason about.

Prefix-aware touch: whoever uses a block also uses every block before it in its chain, so a hit
or an insert marks the block and then its ancestors (followed through `meta.parent` while they
are in L1) most recently used, root last. A prefix is therefore always more recent than its
extensions and chains are evicted from their tails: a leaf without its root is useless, a root
without its leaves is not. Plain LRU would evict a conversation's root first, since it was
saved first. For the same reason a block is refused (not inserted, nothing evicted) when it and
its ancestors together exceed the budget: a chain longer than L1 keeps its head in L1, and its
tail lives in L2 only. The tier remembers the blocks it refused (the last `REFUSED_KEPT`), and
refuses a block whose parent it refused and does not hold: without that, the block after a
refused one found no ancestor here, was taken for a new chain and evicted the chain's own head,
block after block.

Budget: the sum of the sizes of the buffers held never exceeds `capacity_bytes` at any moment;
room is made before a block is inserted, and a block larger than the whole budget is refused.
`put` copies the payload once into a private immutable buffer; `adopt` takes ownership of a
read-only view (a block just read from L2) without copying. Views handed out stay valid after
eviction: the buffer is freed only when its last reader drops it.

Called from any thread; one lock guards the index.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.codec import BlockMeta, byte_view
from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash
from kvtier.core.lru import Lru
from kvtier.core.tiers.base import PutResult, StoredBlock, Tier, TierCounters, TierStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

REFUSED_KEPT = 65_536
"""Refused blocks remembered (least recently refused forgotten first), so that their
descendants are refused too."""


@dataclass(frozen=True, slots=True)
class _Entry:
    block: StoredBlock
    charge: int
    """Bytes charged against the budget: the whole buffer the payload view keeps alive."""


def _footprint(view: memoryview) -> int:
    """Size of the buffer behind `view` (a slice of a larger buffer keeps all of it alive)."""
    owner = view.obj
    try:
        return max(view.nbytes, memoryview(owner).nbytes)
    except TypeError:
        return view.nbytes


def _private_copy(view: memoryview) -> memoryview:
    """A read-only copy in a numpy buffer: numpy asks for transparent huge pages on large
    arrays, which makes the first touch and every later copy out cheaper than `bytes`."""
    array = np.empty(view.nbytes, dtype=np.uint8)
    array.data[:] = view
    array.flags.writeable = False
    return array.data


class MemoryTier:
    """Byte-budgeted LRU block cache in host memory."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes: must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU first, MRU last
        self._used = 0
        self._refused: Lru[BlockHash, bool] = Lru(REFUSED_KEPT)
        """Blocks refused and not held since: the parents whose children are refused."""
        self._counters = TierCounters()

    @property
    def tier(self) -> Tier:
        return Tier.L1

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, block_hash: BlockHash) -> bool:
        """Presence check; does not change recency."""
        return block_hash in self._entries

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return [h in self._entries for h in hashes]

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        return [self.get(h) for h in hashes]

    def get(self, block_hash: BlockHash) -> StoredBlock | None:
        """The block, marked most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is not None:
                self._touch_chain(block_hash)
        if entry is None:
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_read=entry.block.payload.nbytes)
        return entry.block

    def peek(self, block_hash: BlockHash) -> StoredBlock | None:
        """The block without touching recency or counters (for write-through to L2)."""
        entry = self._entries.get(block_hash)
        return None if entry is None else entry.block

    def _touch_chain(self, block_hash: BlockHash) -> int:
        """Mark the block, then its ancestors held here, most recently used (lock held).

        Returns the bytes charged for the blocks touched."""
        h, touched = block_hash, 0
        for _ in range(len(self._entries)):  # bound: a forged cycle of parents cannot spin
            entry = self._entries.get(h)
            if entry is None:
                break
            self._entries.move_to_end(h)
            touched += entry.charge
            h = entry.block.meta.parent
        return touched

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: Buffer) -> PutResult:
        """Store one private copy of `payload` (the caller may reuse its buffer afterwards)."""
        if block_hash in self._entries:
            self._counters.add(already_present=1)
            return PutResult(stored=False)
        view = byte_view(payload)
        with self._lock:  # (before the copy: a refused block costs no copy)
            if view.nbytes > self._capacity or self._in_refused_tail(meta.parent):
                return self._refuse(block_hash)
        copy = _private_copy(view)  # outside the lock: it is the expensive part
        return self._insert(block_hash, StoredBlock(meta, copy), copy.nbytes)

    def adopt(self, block_hash: BlockHash, block: StoredBlock) -> PutResult:
        """Insert `block` without copying; its payload must be read-only and never mutated."""
        if not block.payload.readonly:
            raise ValueError("payload: adopt needs a read-only view")
        return self._insert(block_hash, block, _footprint(block.payload))

    def _insert(self, block_hash: BlockHash, block: StoredBlock, charge: int) -> PutResult:
        evicted: list[BlockHash] = []
        with self._lock:
            if block_hash in self._entries:
                self._counters.add(already_present=1)
                return PutResult(stored=False)
            # The block's ancestors become the most recent entries; if they and the block do
            # not fit together, the block is refused rather than evicting its own prefix.
            ancestors = self._touch_chain(block.meta.parent)
            if ancestors + charge > self._capacity or self._in_refused_tail(block.meta.parent):
                return self._refuse(block_hash)
            self._refused.pop(block_hash)
            while self._used + charge > self._capacity:  # never reaches the ancestors
                old_hash, old = self._entries.popitem(last=False)
                self._used -= old.charge
                evicted.append(old_hash)
            self._entries[block_hash] = _Entry(block, charge)
            self._used += charge
            self._touch_chain(block.meta.parent)
        self._counters.add(stored=1, bytes_written=block.payload.nbytes, evicted=len(evicted))
        return PutResult(stored=True, evicted=tuple(evicted))

    def _in_refused_tail(self, parent: BlockHash) -> bool:
        """Whether a block of parent `parent` extends a chain past a block refused here."""
        return parent in self._refused and parent not in self._entries

    def _refuse(self, block_hash: BlockHash) -> PutResult:
        """Refuse the block (counted in `rejected`), remembering it for its descendants (lock
        held)."""
        self._refused.put(block_hash, True)
        self._counters.add(rejected=1)
        return PutResult(stored=False)

    def remove(self, block_hash: BlockHash) -> bool:
        with self._lock:
            entry = self._entries.pop(block_hash, None)
            if entry is not None:
                self._used -= entry.charge
        return entry is not None

    def order(self) -> list[BlockHash]:
        """Held blocks from next-to-evict to most recently used."""
        with self._lock:
            return list(self._entries)

    def close(self) -> None:
        """Drop every block (views already handed out stay valid)."""
        with self._lock:
            self._entries.clear()
            self._used = 0

    def stats(self) -> TierStats:
        with self._lock:
            used, objects = self._used, len(self._entries)
        return self._counters.snapshot(
            used_bytes=used, capacity_bytes=self._capacity, objects=objects
        )
