"""TieredStore: one replica's view of L1 (host memory) and L2 (the shared pool).

Operations, all thread-safe (the vLLM connector calls them from the scheduler thread and from
its worker threads):

    lookup(hashes)  scheduler, every step of a waiting request: tiers of the longest contiguous
                    prefix present now. No side effects on contents or recency; L2 existence
                    answers are cached for `l2_exists_ttl_s`.
    load(hashes)    worker, once per hit: the leading blocks, stopping at the first one missing
                    or invalid. L2 hits are promoted into L1 (whose LRU keeps a prefix more
                    recent than its extensions, see `kvtier.core.tiers.memory`).
    load_into(hashes, consume, staging, pool)
                    the connector's load: the same blocks handed one by one to `consume`, L2
                    hits read ahead on `pool` into the caller's reused `staging` buffers and not
                    promoted (the caller promotes them later, off its critical path, by saving
                    them again).
    save(h, ...)    worker, once per computed full block: the admission policy decides; an
                    admitted block is copied once into L1 synchronously (or, handed over with
                    `adopt=True`, taken without a copy) and queued for an asynchronous
                    write-through to L2. The queue is bounded: when it is full the L2 write is
                    dropped and counted, never waited for.
    has_near(h)     worker, before saving a block: whether the nearest tier holds it already.
    in_l1(h)        scheduler, for blocks a lookup takes without a check: whether L1 holds it.
    flush / close   owner: wait for queued L2 writes; close drains or abandons them (counted)
                    and stops the I/O threads this store started, and the L2 capacity
                    janitor it runs when `l2_capacity_bytes` is set (`kvtier.core.tiers.shared`).

Tier faults never reach callers: a failed read is a miss, a failed write is counted.
`on_event(kind, tier, hashes)` reports blocks landing in (STORED) or leaving (REMOVED) a tier;
it runs on the thread that caused the change (a caller's for L1, an I/O thread's for L2) and
must not block; exceptions it raises are logged and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from kvtier.core.admission import make_policy
from kvtier.core.clock import deadline_in, seconds_left
from kvtier.core.codec import BlockMeta, byte_view, check_payload_length
from kvtier.core.errors import TierError
from kvtier.core.events import EventKind
from kvtier.core.keys import BlockHash, ModelIdentity
from kvtier.core.read_ahead import Staged, read_ahead
from kvtier.core.settings import StoreSettings
from kvtier.core.tiers.base import (
    BlockTier,
    PutResult,
    ReadsInto,
    ReadTimes,
    StoredBlock,
    Tier,
    TierStats,
)
from kvtier.core.tiers.janitor import JanitorStats
from kvtier.core.tiers.memory import MemoryTier
from kvtier.core.tiers.posix import OpenedBlock, PosixTier
from kvtier.core.tiers.shared import SharedL2, open_shared_l2
from kvtier.core.write_behind import WriteBehind

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

EventSink = Callable[[EventKind, Tier, Sequence[BlockHash]], None]

__all__ = ["LoadedBlock", "StoreStats", "TieredStore"]

L2_BATCH = 16
"""Blocks per L2 existence check or read batch: one round trip for a network tier, while a
prefix that ends early costs a directory tier at most this many wasted checks."""


@dataclass(frozen=True, slots=True)
class LoadedBlock:
    block_hash: BlockHash
    meta: BlockMeta
    payload: memoryview
    """Read-only view; valid until the caller drops it (eviction does not invalidate it), except
    a block `load_into` read into the caller's staging buffer: valid until `consume` returns."""
    tier: Tier
    """Where it was found (L1 or L2)."""


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's counters."""

    l1: TierStats | None
    """None when L1 is disabled (`l1_bytes=0`)."""
    l2: TierStats | None
    """None when L2 is disabled or unusable (see `l2_disabled_reason`)."""
    l2_disabled_reason: str | None
    saves: int
    admission_rejected: int
    l2_queued: int
    """Write-through jobs accepted into the queue."""
    l2_dropped: int
    """Write-through jobs dropped because the queue was full (or the store was closing)."""
    l2_abandoned: int
    """Queued jobs discarded by `close(drain=False)` or a drain timeout."""
    l2_write_errors: int
    """Jobs whose L2 write raised unexpectedly (tier faults are counted in `l2.errors`)."""
    l2_write_cpu_seconds: float
    """CPU time the L2 writer threads spent writing (checksum, copy into the file system)."""
    l2_queue_depth: int
    """Jobs queued or being written right now."""
    lookups: int
    lookup_blocks: int
    """Blocks asked about by `lookup`."""
    lookup_hit_blocks: int
    """Blocks of the contiguous prefixes `lookup` found."""
    event_errors: int
    janitor: JanitorStats | None = None
    """The L2 capacity janitor this store runs (None: none here)."""


class TieredStore:
    """Longest-prefix lookup, promotion, admission and write-through over L1 and L2."""

    def __init__(
        self,
        config: StoreSettings,
        identity: ModelIdentity,
        on_event: EventSink | None = None,
        *,
        l2_tier: BlockTier | None = None,
        clock: Callable[[], float] = time.monotonic,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        """The store builds the L2 `config` names (`l2_path` or `l2_url`, with the capacity
        janitor; see `kvtier.core.tiers.shared`) and closes it. `l2_tier` replaces it (another
        backend, or a test double); its creator keeps ownership and closes it.
        `clock` times the L2 existence TTLs (tests pass a fake one). `thread_init` runs first
        in each L2 writer thread (the connector moves them off the engine's cores)."""
        self.config = config
        self.identity = identity
        self.namespace = identity.namespace()
        self._on_event = on_event
        self._policy = make_policy(config)
        self._l1 = MemoryTier(config.l1_bytes) if config.l1_bytes > 0 else None
        self._l2: BlockTier | None = l2_tier
        self._shared: SharedL2 | None = None  # what this store built, and closes
        self._l2_disabled_reason: str | None = None
        if l2_tier is None:
            try:
                self._shared = open_shared_l2(config, identity, clock=clock)
            except TierError as exc:
                self._l2_disabled_reason = str(exc)
                log.warning("kvtier: L2 disabled, running L1-only: %s", exc)
            if self._shared is not None:
                self._l2 = self._shared.tier
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            (
                "saves",
                "admission_rejected",
                "lookups",
                "lookup_blocks",
                "lookup_hit_blocks",
                "event_errors",
            ),
            0,
        )
        self._closed = False
        self._writes = (
            None
            if self._l2 is None
            else WriteBehind(
                self._l2,
                queue_blocks=config.write_queue_blocks,
                threads=config.io_threads,
                confirm_ttl_s=config.l2_exists_ttl_s,
                clock=clock,
                on_written=lambda result, h: self._record(result, Tier.L2, h),
                thread_init=thread_init,
            )
        )

    # ---- public API ---------------------------------------------------------------------

    @property
    def l2_enabled(self) -> bool:
        return self._l2 is not None

    def lookup(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        """Tiers of the longest contiguous prefix of `hashes` available now."""
        found: list[Tier] = []
        while len(found) < len(hashes):
            tiers = self._locate(hashes[len(found) : len(found) + L2_BATCH])
            found += tiers
            if len(tiers) < L2_BATCH:
                break
        self._count(lookups=1, lookup_blocks=len(hashes), lookup_hit_blocks=len(found))
        return found

    def contains(self, block_hash: BlockHash) -> Tier | None:
        """The nearest tier holding `block_hash` now, without side effects."""
        tiers = self._locate([block_hash])
        return tiers[0] if tiers else None

    def load(self, hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The leading blocks of `hashes` that could be read, in order; L2 hits go into L1.

        Runs of blocks missing from L1 are read from L2 in batches of up to `L2_BATCH`.
        """
        loaded: list[LoadedBlock] = []
        self.load_into(hashes, loaded.append)
        return loaded

    def load_into(
        self,
        hashes: Sequence[BlockHash],
        consume: Callable[[LoadedBlock], None],
        *,
        staging: Sequence[memoryview] = (),
        pool: Executor | None = None,
        times: ReadTimes | None = None,
    ) -> int:
        """Hand the leading readable blocks of `hashes` to `consume`, in order; returns how many.

        L1 hits are L1's own views. With `staging` (buffers of one payload each) and an L2 that
        `ReadsInto`, L2 hits are read into those buffers, ahead of `consume` on `pool`
        (`kvtier.core.read_ahead`); `consume` must copy each out before it returns. They are
        not promoted into L1: promotion needs a fresh buffer per block, whose page faults cost
        more than the read itself, on the caller's critical path (the connector promotes later,
        from the engine's copy). Else L2 hits are read in batches of up to `L2_BATCH` and
        promoted (`load`). Stops at the first block missing or invalid; `times` accumulates the
        phases of staged L2 reads; whatever `consume` raises propagates.
        """
        if staging and isinstance(self._l2, ReadsInto):
            l1 = self._l1

            def hand_out(block: Staged) -> None:
                tier = Tier.L1 if block.local else Tier.L2
                consume(LoadedBlock(block.block_hash, block.meta, block.payload, tier))

            return read_ahead(
                hashes,
                local=l1.get if l1 is not None else lambda h: None,
                read=self._l2_read_into,
                consume=hand_out,
                buffers=staging,
                pool=pool,
                times=times,
            )
        done = 0
        while done < len(hashes):
            h = hashes[done]
            block = self._l1.get(h) if self._l1 is not None else None
            if block is not None:
                consume(LoadedBlock(h, block.meta, block.payload, Tier.L1))
                done += 1
                continue
            run = self._l1_miss_run(hashes[done : done + L2_BATCH])
            for rh, rblock in zip(run, self._l2_read(run), strict=True):
                if rblock is None:
                    return done
                self._promote(rh, rblock)
                consume(LoadedBlock(rh, rblock.meta, rblock.payload, Tier.L2))
                done += 1
        return done

    @property
    def piece_reads(self) -> bool:
        """Whether L2 blocks should be read in pieces (`open_pieces`): on a file system the
        L2 profile names for it."""
        return isinstance(self._l2, PosixTier) and self._l2.piece_reads

    def open_pieces(
        self,
        hashes: Sequence[BlockHash],
        payload_bytes: int,
        *,
        pool: Executor | None = None,
        times: ReadTimes | None = None,
    ) -> list[LoadedBlock | OpenedBlock]:
        """The leading available blocks of `hashes`: L1 hits as L1's own views, L2 hits opened
        (`PosixTier.open_block`: files of `payload_bytes`), their header and payload for the
        caller to read in pieces and `finish` (or `abandon`). With `pool` the files are opened
        in parallel on it. Stops at the first block missing; `times` gets the opening time."""
        start = time.perf_counter()
        held = [self._l1.get(h) if self._l1 is not None else None for h in hashes]
        opening = [
            pool.submit(self._open_l2, h, payload_bytes)
            if pool is not None and local is None
            else None
            for h, local in zip(hashes, held, strict=True)
        ]
        out: list[LoadedBlock | OpenedBlock] = []
        for h, local, job in zip(hashes, held, opening, strict=True):
            if local is not None:
                out.append(LoadedBlock(h, local.meta, local.payload, Tier.L1))
                continue
            opened = job.result() if job is not None else self._open_l2(h, payload_bytes)
            if opened is None:
                break
            out.append(opened)
        for job in opening[len(out) :]:  # opened past the first miss: closed again
            if job is not None and not job.cancel() and (late := job.result()) is not None:
                late.abandon()
        if times is not None:
            times.open_s += time.perf_counter() - start
        return out

    def _open_l2(self, block_hash: BlockHash, payload_bytes: int) -> OpenedBlock | None:
        assert isinstance(self._l2, PosixTier)
        try:
            return self._l2.open_block(block_hash, payload_bytes)
        except Exception:
            log.exception("kvtier: L2 open failed; treating it as a miss")
            return None

    def in_l1(self, block_hash: BlockHash) -> bool:
        """Whether this process's L1 holds `block_hash` (no L2 round trip)."""
        return self._l1 is not None and self._l1.contains(block_hash)

    def has_near(self, block_hash: BlockHash) -> bool:
        """Whether the nearest tier holds `block_hash` (L1 when it is on, else L2): saving it
        again would change nothing. A block only in L2 is worth saving with L1 on: that is how
        a block loaded from L2 reaches L1."""
        if self._l1 is not None:
            return self._l1.contains(block_hash)
        return bool(self._l2_exists([block_hash])[0])

    def save(
        self,
        block_hash: BlockHash,
        meta: BlockMeta,
        payload: Buffer,
        *,
        reused: bool = False,
        prefix_tokens: int | None = None,
        adopt: bool = False,
    ) -> bool:
        """Offer one full block; returns whether the admission policy admitted it.

        `reused` says the block's prefix was already hit before (for the "reused" policy);
        `prefix_tokens` is the number of tokens up to the end of this block (for
        "min-tokens"; defaults to the block's own tokens). `payload` may be reused by the
        caller as soon as this returns, unless `adopt`: then the caller hands it over (never
        writes it again) and L1 keeps it without a copy. Raises `CodecError` only if the
        payload length contradicts `meta` (a caller bug).
        """
        view = byte_view(payload)
        check_payload_length(meta, view.nbytes)
        if self._closed:
            return False
        self._count(saves=1)
        if not self._policy.admit(block_hash, meta, reused=reused, prefix_tokens=prefix_tokens):
            self._count(admission_rejected=1)
            return False
        held: StoredBlock | None = None
        if adopt:
            view = view.toreadonly()
        if self._l1 is not None:
            held = self._l1.peek(block_hash)
            if held is None:
                result = (
                    self._l1.adopt(block_hash, StoredBlock(meta, view))
                    if adopt
                    else self._l1.put(block_hash, meta, view)
                )
                self._record(result, Tier.L1, block_hash)
                held = self._l1.peek(block_hash)
        if self._writes is not None:
            # Write from L1's immutable copy when there is one; else take a private copy,
            # since the caller may overwrite its buffer as soon as save() returns.
            if held is not None:
                source = held.payload
            else:
                source = view if adopt else memoryview(bytes(view))
            self._writes.offer(block_hash, meta, source)
        return True

    def stats(self) -> StoreStats:
        with self._lock:
            counts = dict(self._counts)
        writes = self._writes.snapshot() if self._writes is not None else {}
        return StoreStats(
            l1=None if self._l1 is None else self._l1.stats(),
            l2=None if self._l2 is None else self._l2.stats(),
            l2_disabled_reason=self._l2_disabled_reason,
            l2_queued=writes.get("queued", 0),
            l2_dropped=writes.get("dropped", 0),
            l2_abandoned=writes.get("abandoned", 0),
            l2_write_errors=writes.get("write_errors", 0),
            l2_write_cpu_seconds=0.0 if self._writes is None else self._writes.cpu_seconds(),
            l2_queue_depth=writes.get("depth", 0),
            janitor=self._janitor_stats(),
            **counts,
        )

    def _janitor_stats(self) -> JanitorStats | None:
        janitor = self._shared.janitor if self._shared is not None else None
        return janitor.stats() if janitor is not None else None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued L2 write has finished; False if `timeout_s` ran out first."""
        return True if self._writes is None else self._writes.flush(timeout_s)

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting saves, then finish (`drain`) or abandon queued L2 writes.

        With `drain=True` queued writes are completed for up to `timeout_s`; whatever is left
        then (or everything queued, with `drain=False`) is abandoned and counted. A write
        already in progress cannot be interrupted: the writer threads are joined until
        `timeout_s` (counted from the call) runs out; they are daemons, so a hung mount cannot
        keep the process alive.
        An L2 tier the store built is closed, after its janitor (whose lease is handed over at
        once; a janitor pass stuck in a hung mount is also waited for only until `timeout_s`
        runs out); L1 keeps its blocks until the store is dropped.
        """
        deadline = deadline_in(timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._writes is not None:
            self._writes.close(drain=drain, timeout_s=timeout_s)
        if self._shared is not None:
            self._shared.close(seconds_left(deadline))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _locate(self, hashes: Sequence[BlockHash]) -> list[Tier]:
        """Tiers of the contiguous prefix of `hashes` (one L2 batch for the L1 misses)."""
        in_l1 = self._l1.contains_many(hashes) if self._l1 is not None else [False] * len(hashes)
        misses = [h for h, hit in zip(hashes, in_l1, strict=True) if not hit]
        in_l2 = iter(self._l2_exists(misses) if misses else [])
        found: list[Tier] = []
        for hit in in_l1:
            if hit:
                found.append(Tier.L1)
            elif next(in_l2):
                found.append(Tier.L2)
            else:
                break
        return found

    def _l1_miss_run(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The leading hashes L1 does not hold (at least the first one)."""
        if self._l1 is None:
            return list(hashes)
        run = [hashes[0]]
        for h in hashes[1:]:
            if self._l1.contains(h):
                break
            run.append(h)
        return run

    def _l2_exists(self, hashes: Sequence[BlockHash]) -> list[bool]:
        if self._l2 is None:
            return [False] * len(hashes)
        try:
            return self._l2.contains_many(hashes)
        except Exception:  # a tier must not raise; if it does, it is a miss
            log.exception("kvtier: L2 existence check failed; treating it as a miss")
            return [False] * len(hashes)

    def _l2_read_into(
        self, block_hash: BlockHash, staging: memoryview, times: ReadTimes
    ) -> BlockMeta | None:
        assert isinstance(self._l2, ReadsInto)
        try:
            return self._l2.read_into(block_hash, staging, times)
        except Exception:
            log.exception("kvtier: L2 read failed; treating it as a miss")
            return None

    def _l2_read(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        if self._l2 is None:
            return [None] * len(hashes)
        try:
            return self._l2.get_many(hashes)
        except Exception:
            log.exception("kvtier: L2 read failed; treating it as a miss")
            return [None] * len(hashes)

    def _promote(self, block_hash: BlockHash, block: StoredBlock) -> None:
        if self._l1 is not None:
            self._record(self._l1.adopt(block_hash, block), Tier.L1, block_hash)

    def _record(self, result: PutResult, tier: Tier, block_hash: BlockHash) -> None:
        """Announce what a put changed: evictions first, then the new block."""
        if result.evicted:
            self._emit(EventKind.REMOVED, tier, result.evicted)
        if result.stored:
            self._emit(EventKind.STORED, tier, (block_hash,))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _emit(self, kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(kind, tier, hashes)
        except Exception:
            self._count(event_errors=1)
            log.exception("kvtier: on_event callback failed for %s %s", kind, tier)
