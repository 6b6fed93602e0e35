"""The storage-tier protocol every L1/L2 backend implements, and per-tier statistics.

Operations (all thread-safe; called by `kvtier.core.store.TieredStore` from the engine's scheduler
thread, its worker threads and the store's own I/O threads, once per block):

    contains(h)       is the block there now? No side effects on contents or recency.
    contains_many(hs) `contains` for many blocks at once (one round trip where the backend
                      allows it); the store asks for a prefix's blocks in chunks.
    get(h)            the block's meta and a read-only payload view, or None on a miss.
                      A block that fails validation is a miss; the tier removes and counts it.
    get_many(hs)      `get` for many blocks at once, results in order.
    read_into(h, out) optional (`ReadsInto`): the payload read into the caller's buffer `out`
                      (no buffer allocated per read), validated like `get`; returns the meta.
    put(h, meta, p)   store a copy of payload `p`; reports whether it was stored and which blocks
                      were evicted to make room. A block already present is not rewritten.
    remove(h)         delete the block if present.
    stats()           a frozen snapshot of the tier's counters.
    close()           release connections or threads the tier holds (called by its owner).

Tier faults (I/O errors, a vanished mount) never raise out of these calls: they become misses
or failed puts and are counted in `TierStats.errors`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash

if TYPE_CHECKING:
    from typing_extensions import Buffer


class Tier(StrEnum):
    """Where a block lives. L0 is the engine's own cache; L2 is shared by all replicas."""

    L0 = "l0"
    L1 = "l1"
    L2 = "l2"


TIER_ORDER: tuple[Tier, ...] = (Tier.L0, Tier.L1, Tier.L2)
"""Tiers from nearest (cheapest to load) to farthest."""


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block as a tier hands it out."""

    meta: BlockMeta
    payload: memoryview
    """Read-only view of the payload; the tier never writes into it again, so it stays valid
    for as long as the caller holds it, even after the block is evicted."""


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: bool
    """True if this call wrote the block; False if it was already there or could not be written."""
    evicted: tuple[BlockHash, ...] = ()
    """Blocks removed to make room, oldest first."""


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier since it was opened."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    """Payload bytes handed out by `get` hits."""
    bytes_written: int = 0
    """Payload bytes stored by `put`."""
    stored: int = 0
    """Blocks written by `put` (not counting blocks that were already present)."""
    already_present: int = 0
    """`put` calls that found the block already there (another writer won, or a repeat)."""
    evicted: int = 0
    rejected: int = 0
    """Blocks `put` refused (e.g. larger than the whole L1 budget)."""
    corrupt_removed: int = 0
    """Objects that failed validation on read and were deleted."""
    errors: int = 0
    """I/O faults turned into misses or failed puts."""
    used_bytes: int = 0
    """Bytes currently held (L1 only; 0 for tiers that do not track it)."""
    capacity_bytes: int | None = None
    """Byte budget (None: unbounded here, e.g. L2 bounded by its janitor)."""
    objects: int | None = None
    """Blocks currently held, where the tier knows it cheaply."""


@dataclass(slots=True)
class TierCounters:
    """Mutable, lock-protected counters behind `TierStats` (owned by one tier instance)."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _values: dict[str, int] = field(default_factory=dict)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] = self._values.get(name, 0) + delta

    def snapshot(
        self, *, used_bytes: int = 0, capacity_bytes: int | None = None, objects: int | None = None
    ) -> TierStats:
        with self._lock:
            values = dict(self._values)
        return TierStats(
            **values, used_bytes=used_bytes, capacity_bytes=capacity_bytes, objects=objects
        )


@dataclass(slots=True)
class ReadTimes:
    """Seconds block reads spent per phase: one instance per reading thread (not locked)."""

    open_s: float = 0.0
    """Opening the object, reading and validating its header."""
    read_s: float = 0.0
    """Reading the payload."""
    checksum_s: float = 0.0
    """Hashing the payload (the checksum check)."""

    def add(self, other: ReadTimes) -> None:
        self.open_s += other.open_s
        self.read_s += other.read_s
        self.checksum_s += other.checksum_s


class BlockTier(Protocol):
    """One storage tier (see the module docstring for the contract)."""

    @property
    def tier(self) -> Tier: ...

    def contains(self, block_hash: BlockHash) -> bool: ...

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]: ...

    def get(self, block_hash: BlockHash) -> StoredBlock | None: ...

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]: ...

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: Buffer) -> PutResult: ...

    def remove(self, block_hash: BlockHash) -> bool: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


@runtime_checkable
class ReadsInto(Protocol):
    """A tier that reads a payload into a buffer the caller owns and reuses (a staging buffer):
    no allocation, page faults or fresh memory per read. On a miss or an invalid block it
    returns None and `out` holds garbage; a buffer whose size is not the payload's is a miss
    too (the block is left alone). `times`, when given, accumulates the phases of the read."""

    def read_into(
        self, block_hash: BlockHash, out: memoryview, times: ReadTimes | None = None
    ) -> BlockMeta | None: ...
