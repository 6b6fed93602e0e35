"""Scheduler-side connector: finds cached prefixes and plans loads and saves.

Runs on vLLM's scheduler thread (engine-core process), once per scheduling step:

    new_request(request)             once per request on arrival: start tracking it.
    matched_tokens(request, local)   for each waiting request, possibly several times per step.
                                     Never blocks: the first call queues a lookup on the
                                     lookup thread and answers None ("ask again next step");
                                     a later call answers from the finished lookup while it is
                                     younger than `lookup_ttl_s`. No side effects on the store.
                                     A lookup unanswered `load_deadline_s` after it was
                                     queued answers 0 (vLLM computes the prompt), and so does
                                     every request while the lookup thread is stuck in one
                                     lookup longer than that (a stalled L2 mount): nothing
                                     more is queued behind it.
    after_alloc(request, blocks, n)  once blocks are allocated for an external hit: plans the
                                     load (asynchronous by default: the request waits in vLLM's
                                     WAITING_FOR_REMOTE_KVS until the worker reports it; with
                                     `load_async=False` the worker loads before the forward).
    apply_worker_meta(meta)          every step: the workers' L1 changes (L1 mirror).
    build_meta(scheduler_output)     every step: the planned loads, plus saves of every full
                                     kvtier block the step completes (and of the blocks a load
                                     supplied; never of L0 hits, computed and offered by the
                                     earlier requests that computed them), each naming the
                                     blocks before it that recent synchronous loads wrote.
    finished(request)                once per request: True keeps its blocks allocated until
                                     the workers report its saves done (`get_finished`).
    reset()                          vLLM's `reset_cache` (`/reset_prefix_cache` with
                                     `reset_external`, `pause_generation(clear_cache=True)`):
                                     the weights may have changed, so no block cached before
                                     is ever loaded again (see `reset`).

Counting rules: only full kvtier blocks, only the longest contiguous prefix that exists now,
and never the last prompt token (vLLM must compute at least one token to sample from).

A lookup bisects (`SchedulerSide._find`): the first block's existence check (a cold prompt
costs one), then the last's, then halving the range between the last block known held and the
first known missing, about 2 + log2(n) checks for n blocks instead of n: on a FUSE mount each
is a round trip to the daemon. A held block is taken to mean its predecessors are held too:
a chain is saved in order, and read and evicted with its prefix. A block taken so that is
missing after all (a hole: a dropped save, a removed corrupt block) fails its load, which vLLM
recomputes (`kv_load_failure_policy: recompute`).

Timing (`ConnectorCounters`): the lookup thread's work (`phase_lookup_seconds`), how long
requests waited for lookup answers from the first ask to the answer used
(`phase_lookup_wait_seconds`), how many "ask again" answers that took (`lookup_deferred`,
one scheduler step each), and how many answers were 0 for a lookup past its deadline
(`lookup_deadline_missed`).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.core.daemon_pool import DaemonPool
from kvtier.core.events import EventKind
from kvtier.core.keys import BlockHash, block_hashes, root_hash
from kvtier.core.tiers.base import TIER_ORDER, Tier
from kvtier.vllm import compat
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMeta, LoadSpec, SaveSpec
from kvtier.vllm.process_store import ProcessStore
from kvtier.vllm.stats import ConnectorCounters

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Lookup:
    n_hashes: int
    future: Future[list[Tier]]
    queued_at: float
    done_at: float | None = None


@dataclass(slots=True)
class _Tracked:
    """What the scheduler side remembers about one live request."""

    request: Request
    extra: bytes
    """The request's attributes that split the cache (`compat.request_extra`): the root of
    the engine-block hashes the router is sent."""
    kv_extra: bytes
    """`extra` and the cache epoch: the root of the kvtier hashes the tiers are keyed by."""
    hashes: list[BlockHash] = field(default_factory=list)
    engine_hashes: list[BlockHash] = field(default_factory=list)
    lookup: _Lookup | None = None
    asked_at: float | None = None
    """When the lookups behind the next answer started (for the lookup-wait timing)."""
    local_tokens: int = 0
    """Block-aligned local (L0) hit given to the last `matched_tokens` that found more."""
    found: list[Tier] = field(default_factory=list)
    handled_blocks: int | None = None
    """Leading kvtier blocks already offered to the store, or never to offer (L0 hits: the
    requests that computed them offered them); None until the request is first scheduled."""
    hit_blocks: int = 0
    """Leading kvtier blocks that were cache hits (L0 or external)."""
    from_l2: set[int] = field(default_factory=set)
    """Chain positions of the blocks planned to load from L2 (promoted into L1 once saved)."""
    has_saves: bool = False
    hit_tokens: dict[Tier, int] = field(default_factory=dict)
    before_reset: bool = False
    """Scheduled before a cache reset: its KV may come from the old weights, so it neither
    loads nor saves again."""
    stale_after: int | None = None
    """Tokens after which its KV was computed from a block that failed to load in an earlier
    step (`computed_from`): nothing is saved until vLLM recomputes from there or before."""


class SchedulerSide:
    def __init__(
        self,
        stores: Sequence[ProcessStore],
        block_tokens: int,
        engine_block_tokens: int,
        lookup_ttl_s: float,
        counters: ConnectorCounters,
        events: bool,
        block_ids_of: Callable[[str], list[int]],
        load_async: bool,
        lookup_wait_s: float = 0.0,
        lookup_deadline_s: float = 2.0,
        batches_in_flight: int = 1,
    ) -> None:
        """`stores`: one per TP rank (a block counts only if every rank has it);
        `block_ids_of(req_id)`: the request's engine block ids (vLLM's KV cache manager);
        `lookup_deadline_s`: `ConnectorSettings.load_deadline_s`; `batches_in_flight`:
        `compat.batches_in_flight` (how many steps' loads a save plan names, `loaded_before`)."""
        self._stores = list(stores)
        self._block = block_tokens
        self._engine_block = engine_block_tokens
        self._per_block = block_tokens // engine_block_tokens
        self._ttl = lookup_ttl_s
        self._counters = counters
        self._events = events
        self._block_ids_of = block_ids_of
        self._load_async = load_async
        self._lookup_wait_s = lookup_wait_s
        self._deadline_s = lookup_deadline_s
        self._tracked: dict[str, _Tracked] = {}
        self._epoch = b""
        """Appended to every chain's root; a reset draws a new one (empty until then, so the
        blocks of every replica that was never reset share one chain)."""
        # Per TP rank: kvtier blocks in that worker's L1, mirrored from its reports (the
        # workers may live in other processes). Written on the scheduler thread, read by the
        # lookup thread.
        self._l1: list[set[BlockHash]] = [set() for _ in self._stores]
        self._l1_lock = threading.Lock()
        self._loads: list[LoadSpec] = []
        self._recent_loads: deque[frozenset[int]] = deque(maxlen=batches_in_flight)
        """Engine blocks written by the synchronous loads of the last steps, newest last."""
        self._recent_chains: deque[list[tuple[str, tuple[int, ...]]]] = deque(
            maxlen=batches_in_flight
        )
        """Per step in flight, each scheduled request holding a block such a load wrote, with
        its engine block ids (what a step computed after a failed one is stale too)."""
        self._lookups = DaemonPool(1, "kvtier-lookup")
        self._running_since: float | None = None
        """When the lookup thread started the lookup it runs now (None: idle)."""
        self._checks = DaemonPool(len(self._stores), "kvtier-exists")

    # ---- vLLM hooks ---------------------------------------------------------------------

    def new_request(self, request: Request) -> None:
        """Every request is tracked from arrival: one served wholly from L0 still saves."""
        self._track(request)

    def matched_tokens(self, request: Request, local_tokens: int) -> tuple[int | None, bool]:
        tokens = compat.request_token_ids(request)
        if tokens is None:
            return 0, False
        usable = (len(tokens) - 1) // self._block  # never the last token
        if usable * self._block <= local_tokens:
            return 0, False  # L0 already covers everything we could offer
        tracked = self._track(request)
        if tracked.before_reset:
            return 0, False
        self._extend_hashes(tracked, tokens, usable)
        lookup = tracked.lookup
        now = time.monotonic()
        if (
            lookup is None
            or lookup.n_hashes < usable
            or (lookup.done_at is not None and now - lookup.done_at > self._ttl)
        ):
            if self._stalled(now):
                return self._give_up(tracked)
            lookup = tracked.lookup = self._submit(tracked.hashes[:usable], now)
            if tracked.asked_at is None:
                tracked.asked_at = now
            if self._lookup_wait_s <= 0:
                self._counters.add(lookup_deferred=1)
                return None, False
            # A short, bounded wait: in-memory and local lookups answer within it.
            wait([lookup.future], timeout=self._lookup_wait_s)
        if not lookup.future.done():
            if now - lookup.queued_at > self._deadline_s or self._stalled(now):
                return self._give_up(tracked)
            self._counters.add(lookup_deferred=1)
            return None, False
        self._answered(tracked)
        found = self._found(lookup)[:usable]
        matched = len(found) * self._block
        if matched <= local_tokens:
            return 0, False
        tracked.local_tokens = local_tokens
        tracked.found = found
        return matched - local_tokens, self._load_async

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external == 0:
            return
        tracked = self._tracked[request.request_id]
        local = tracked.local_tokens
        end = local + num_external  # vLLM may trim our answer: it can end inside a block
        first, last = local // self._block, -(-end // self._block)
        skip = (local % self._block) // self._engine_block
        ids = compat.block_ids(blocks)
        p = self._per_block
        tiers = tuple(tracked.found[first:last])
        self._loads.append(
            LoadSpec(
                req_id=request.request_id,
                hashes=tuple(tracked.hashes[first:last]),
                engine_block_ids=tuple(ids[first * p + skip : end // self._engine_block]),
                skip=skip,
                tiers=tiers,
                engine_hashes=tuple(tracked.engine_hashes[first * p : last * p]),
                asynchronous=self._load_async,
                planned_at=time.monotonic(),
            )
        )
        hit_tokens: dict[Tier, int] = {}
        for i, tier in enumerate(tiers):
            start = max(local, (first + i) * self._block)
            n = min(end, (first + i + 1) * self._block) - start
            hit_tokens[tier] = hit_tokens.get(tier, 0) + n
        tracked.hit_tokens = hit_tokens
        tracked.from_l2.update(first + i for i, tier in enumerate(tiers) if tier == Tier.L2)
        self._counters.add(
            hit_tokens_l1=hit_tokens.get(Tier.L1, 0), hit_tokens_l2=hit_tokens.get(Tier.L2, 0)
        )
        # The save plan offers the loaded blocks, not the L0 hits before them: the saver
        # promotes L2 hits into L1 (and skips those L1 holds), and leaves a block whose load
        # fails out of that step's saves, with the blocks computed from it; they are offered
        # again once vLLM has recomputed them (`_plan_save` sees vLLM go back).
        tracked.handled_blocks = first
        tracked.hit_blocks = max(tracked.hit_blocks, last)
        tracked.lookup = None

    def hit_tokens(self, request: Request) -> dict[Tier, int]:
        """Tokens of the planned load per tier (for vLLM's per-source hit metrics)."""
        tracked = self._tracked.get(request.request_id)
        return dict(tracked.hit_tokens) if tracked is not None else {}

    def build_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        meta = KvtierMetadata(
            loads=self._loads, preempted=frozenset(scheduler_output.preempted_req_ids or ())
        )
        self._recent_loads.append(
            frozenset(
                i for load in self._loads if not load.asynchronous for i in load.engine_block_ids
            )
        )
        loaded = frozenset[int]().union(*self._recent_loads)
        self._loads = []
        self._recent_chains.append(self._chains_through(loaded, scheduler_output))
        for req_id in meta.preempted:  # vLLM freed its blocks; the worker drops its saves
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.has_saves = False
        for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            spec = self._plan_save(tracked, n_scheduled, loaded)
            if spec is not None:
                meta.saves.append(spec)
        return meta

    def computed_from(self, failed: set[int]) -> set[int]:
        """`failed` (engine blocks a synchronous load failed to write) and the blocks the
        recent steps computed after one of them in a request, from its stale KV: vLLM caches a
        step's blocks when it schedules them, and with the `recompute` policy keeps them
        cached, stale until their request recomputes them (never, if it is aborted first)."""
        stale = set(failed)
        steps = list(zip(self._recent_loads, self._recent_chains, strict=True))
        failing_step = next((k for k, (loads, _) in enumerate(steps) if failed & loads), None)
        for k, (_, chains) in enumerate(steps):
            for req_id, chain in chains:
                first = next((i for i, block in enumerate(chain) if block in failed), None)
                if first is None:
                    continue
                stale.update(chain[first:])
                if failing_step is not None and k > failing_step:
                    self._computed_on_from(req_id, first * self._engine_block)
        return stale

    def _computed_on_from(self, req_id: str, tokens: int) -> None:
        """Bar the saves of a request scheduled after a load that failed at `tokens` of its
        chain: vLLM takes back the requests of the failing step (their computation is redone),
        not one of a later step (asynchronous scheduling), which computed on from the stale
        block."""
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            after = tokens if tracked.stale_after is None else min(tokens, tracked.stale_after)
            tracked.stale_after = after

    def apply_worker_meta(self, meta: KvtierWorkerMeta) -> None:
        with self._l1_lock:
            for rank, (kind, hashes) in meta.changes:
                if kind == EventKind.STORED:
                    self._l1[rank].update(hashes)
                elif kind == EventKind.REMOVED:
                    self._l1[rank].difference_update(hashes)

    def finished(self, request: Request) -> bool:
        tracked = self._tracked.pop(request.request_id, None)
        return tracked is not None and tracked.has_saves

    def reset(self) -> None:
        """Never load a block cached before now. Chains are rooted in a new random epoch, so
        this engine's blocks from now on are its own (other replicas, and this one after a
        restart, never share them); the old ones stay in the tiers for replicas whose weights
        did not change, and age out. A request scheduled before the reset neither loads nor
        saves again; one only waiting is looked up afresh."""
        self._epoch = b"\x00epoch:" + secrets.token_hex(16).encode()
        for req_id, tracked in list(self._tracked.items()):
            if tracked.handled_blocks is None:
                self._tracked[req_id] = self._new_tracked(tracked.request)
            else:
                tracked.before_reset = True
        self._counters.add(cache_resets=1)
        log.info("kvtier: cache reset; blocks cached before it are no longer loaded")

    def close(self) -> None:
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._checks.shutdown(wait=False, cancel_futures=True)

    # ---- internals ----------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = self._new_tracked(request)
        return tracked

    def _new_tracked(self, request: Request) -> _Tracked:
        extra = compat.request_extra(request)
        return _Tracked(request=request, extra=extra, kv_extra=extra + self._epoch)

    def _extend_hashes(self, tracked: _Tracked, tokens: Sequence[int], n_blocks: int) -> None:
        have = len(tracked.hashes)
        if n_blocks > have:
            parent = tracked.hashes[-1] if have else None
            start = have * self._block
            tracked.hashes += block_hashes(
                tokens[start : n_blocks * self._block], self._block, tracked.kv_extra, parent
            )
        if self._events:
            n_engine = n_blocks * self._per_block
            have_e = len(tracked.engine_hashes)
            if n_engine > have_e:
                parent = tracked.engine_hashes[-1] if have_e else None
                start = have_e * self._engine_block
                tracked.engine_hashes += block_hashes(
                    tokens[start : n_engine * self._engine_block],
                    self._engine_block,
                    tracked.extra,
                    parent,
                )

    def _submit(self, hashes: list[BlockHash], now: float) -> _Lookup:
        future = self._lookups.submit(self._lookup, hashes)
        lookup = _Lookup(n_hashes=len(hashes), future=future, queued_at=now)

        def stamp(done: Future[list[Tier]]) -> None:
            lookup.done_at = time.monotonic()
            if not done.cancelled() and done.exception() is None:
                hit = len(done.result())
                self._counters.add(lookups=1, lookup_blocks=len(hashes), lookup_hit_blocks=hit)

        lookup.future.add_done_callback(stamp)
        return lookup

    def _stalled(self, now: float) -> bool:
        """Whether the lookup thread has been in one lookup longer than the deadline."""
        since = self._running_since
        return since is not None and now - since > self._deadline_s

    def _give_up(self, tracked: _Tracked) -> tuple[int, bool]:
        """Answer 0 (vLLM computes the prompt) for a lookup past the deadline, or one a stuck
        lookup thread would never start. A queued one is cancelled; one running is left to
        end (its answer is not used), and the next ask starts afresh."""
        if tracked.lookup is not None:
            tracked.lookup.future.cancel()
            tracked.lookup = None
        self._answered(tracked)
        self._counters.add(lookup_deadline_missed=1)
        return 0, False

    def _answered(self, tracked: _Tracked) -> None:
        """Time the wait from the first ask to the answer given now."""
        if tracked.asked_at is not None:
            self._counters.add(phase_lookup_wait_seconds=time.monotonic() - tracked.asked_at)
            tracked.asked_at = None

    @staticmethod
    def _found(lookup: _Lookup) -> list[Tier]:
        """The finished lookup's answer; nothing if it failed."""
        if lookup.future.cancelled() or lookup.future.exception() is not None:
            return []
        return lookup.future.result()

    def _lookup(self, hashes: list[BlockHash]) -> list[Tier]:
        start = time.perf_counter()
        self._running_since = time.monotonic()
        try:
            return self._find(hashes)
        finally:
            self._running_since = None
            self._counters.add(phase_lookup_seconds=time.perf_counter() - start)

    def _find(self, hashes: list[BlockHash]) -> list[Tier]:
        """Tiers of the longest prefix every TP rank holds now, by bisection (module docstring).
        A checked block's tier is the farthest among ranks; one taken without a check is L1
        where every rank's L1 holds it (the mirror, or this process's store), else L2."""
        checked: dict[int, Tier] = {}

        def held(i: int) -> bool:
            tier = self._check(hashes[i])
            if tier is not None:
                checked[i] = tier
            return tier is not None

        if not hashes or not held(0):
            return []
        known, missing = 1, len(hashes)  # held: blocks before `known`; not: `missing` on
        if known < missing:
            if held(missing - 1):
                known = missing
            else:
                missing -= 1
        while known < missing:
            middle = (known + missing) // 2
            if held(middle):
                known = middle + 1
            else:
                missing = middle
        return [
            checked[i] if i in checked else self._unchecked_tier(hashes[i]) for i in range(known)
        ]

    def _check(self, block_hash: BlockHash) -> Tier | None:
        """The farthest tier among TP ranks holding the block now; None if one lacks it. The
        stores of the ranks whose L1 mirror lacks it are asked (several at once)."""
        asked = [
            s.store for rank, s in enumerate(self._stores) if not self._mirrored(rank, block_hash)
        ]
        tiers: list[Tier | None]
        if len(asked) > 1:
            tiers = list(self._checks.map(lambda store: store.contains(block_hash), asked))
        else:
            tiers = [store.contains(block_hash) for store in asked]
        if None in tiers:
            return None
        return max((Tier.L1, *(t for t in tiers if t is not None)), key=TIER_ORDER.index)

    def _unchecked_tier(self, block_hash: BlockHash) -> Tier:
        in_l1 = all(
            self._mirrored(rank, block_hash) or s.store.in_l1(block_hash)
            for rank, s in enumerate(self._stores)
        )
        return Tier.L1 if in_l1 else Tier.L2

    def _mirrored(self, rank: int, block_hash: BlockHash) -> bool:
        """Whether rank `rank`'s worker reported the block in its L1."""
        with self._l1_lock:
            return block_hash in self._l1[rank]

    def _chains_through(
        self, loaded: frozenset[int], scheduler_output: SchedulerOutput
    ) -> list[tuple[str, tuple[int, ...]]]:
        """Each request this step schedules that holds a block in `loaded`, with its engine
        block ids."""
        if not loaded:
            return []
        chains = ((r, tuple(self._block_ids_of(r))) for r in scheduler_output.num_scheduled_tokens)
        return [(r, chain) for r, chain in chains if not loaded.isdisjoint(chain)]

    def _plan_save(
        self, tracked: _Tracked, n_scheduled: int, loaded: frozenset[int]
    ) -> SaveSpec | None:
        """The kvtier blocks this step completes (KV computed by its forward pass); `loaded`:
        the engine blocks recent synchronous loads wrote (see `SaveSpec.loaded_before`)."""
        tokens = compat.request_token_ids(tracked.request)
        if tokens is None or tracked.before_reset:
            return None
        done = tracked.request.num_computed_tokens
        if tracked.stale_after is not None:
            if done > tracked.stale_after:
                return None  # computed from a failed block's stale KV
            tracked.stale_after = None  # vLLM recomputes from before it
        first = tracked.handled_blocks
        if first is None:
            # First scheduled, without a load: whatever is computed already is an L0 hit.
            first = tracked.hit_blocks = done // self._block
        elif done < first * self._block:
            # vLLM went back (a failed load, a preemption): it recomputes from `done`, and the
            # blocks from there on are offered again once computed (the saver skips held ones).
            first = done // self._block
            tracked.hit_blocks = min(tracked.hit_blocks, first)
        tracked.handled_blocks = first
        computed = done + n_scheduled
        full = min(computed, len(tokens)) // self._block
        if full <= first:
            return None
        self._extend_hashes(tracked, tokens, full)
        ids = self._block_ids_of(tracked.request.request_id)
        p = self._per_block
        if len(ids) < full * p:
            log.warning(
                "kvtier: request %s has %d blocks, expected >= %d; not saving",
                tracked.request.request_id,
                len(ids),
                full * p,
            )
            return None
        parent = tracked.hashes[first - 1] if first else root_hash(tracked.kv_extra)
        hashes = tuple(tracked.hashes[first:full])
        tracked.handled_blocks = full
        tracked.has_saves = True
        return SaveSpec(
            req_id=tracked.request.request_id,
            hashes=hashes,
            parents=(parent, *hashes[:-1]),
            engine_block_ids=tuple(ids[first * p : full * p]),
            first_index=first,
            reused_blocks=tracked.hit_blocks,
            engine_hashes=tuple(tracked.engine_hashes[first * p : full * p]),
            promote=frozenset(i - first for i in tracked.from_l2 if first <= i < full),
            loaded_before=frozenset(i for i in ids[: first * p] if i in loaded)
            if loaded
            else frozenset(),
        )
