"""Worker-side connector: moves blocks between the store and vLLM's paged KV cache.

Runs in each worker (one per TP rank). vLLM calls, on the worker's execute thread, per step:

    handle_preemptions(meta)   before the step: saves of preempted requests (their blocks are
                               about to be reused) read no engine block after it returns (the
                               rest is dropped and counted); it waits only for a block being
                               copied out, never for the store (a slow L2 cannot stall it).
    start_loads(meta)          queues this step's loads on the loader thread(s) and returns
                               (synchronous loads, the default, are waited for here, at most
                               `load_deadline_s`; with `load_layerwise` their L1 hits, and L2
                               hits from a local directory, are copied into the engine's blocks
                               during the forward pass).
    wait_for_layer(name)       before each attention layer: waits until that layer of the
                               step's layered copy is written.
    submit_saves(meta)         after the forward (`wait_for_save`): ends the layered copy, then
                               queues this step's saves on the saver thread and returns; the
                               forward pass never waits for them. Blocks computed from a
                               block a recent step failed to load are not saved
                               (`_written_blocks`). Past
                               `save_backlog_blocks` blocks waiting to be copied out (blocks L1
                               holds need no copy and are not counted), new saves are dropped
                               and counted: a finished request holds its KV blocks until its
                               saves are done, so a saver that cannot keep up must not hold them.
    finished(ids)              requests whose loads completed, and finished requests whose
                               saves completed (vLLM holds their blocks until then).
    load_errors()              engine block ids that failed to load (vLLM recomputes them).
    worker_meta()              blocks that entered or left this rank's L1 (the scheduler may
                               run in another process and mirrors L1 from these reports).

Deadline: a load still running `load_deadline_s` after it was queued is settled as it stands:
the engine blocks it wrote stay, the others are reported failed (and recomputed), and its
loader thread, maybe still blocked in a read, writes nothing more (a block is written and
the load settled under one lock, so the two never interleave). Synchronous loads are settled
when the step's wait ends; asynchronous ones on the next `finished` call past their deadline.

Background threads (owned here, stopped by `close`):
- loader: `store.load_into`: an L1 hit is copied (`scatter`) from L1 into the request's engine
  blocks (allocated to it alone while it waits for the load); an L2 hit is read into this
  thread's staging buffer (reused: a fresh buffer per block costs page faults that exceed the
  read itself), checksummed, then copied into the engine blocks. With the layered copy, a
  synchronous load leaves its L1 hits to the copier, and its L2 hits too where the L2 tier
  reads in pieces (a local directory): it opens their files and validates their headers, the
  copier reads them layer by layer and verifies each checksum at the end of the step (a
  mismatch is a failed load, recomputed), and a wait past the load deadline settles the copy
  (nothing written afterwards; every block not complete is recomputed). L2 hits are not
  promoted into L1 here, on the request's critical path: the save plan offers the loaded
  blocks again once the request computed on, and the saver copies them into L1 from the
  engine's cache;
- saver: for each block of a save L1 does not hold (`_to_save`; it never asks L2, so a stalled
  mount cannot hold it, nor through it finished requests' blocks), `gather` its engine blocks
  into a fresh host buffer that L1 adopts (one copy) and `store.save` it (written through to
  L2 asynchronously by the store's writers);
- copier: the layered copy of a step's synchronous loads (`kvtier.vllm.layered_copy`), beside
  the forward pass, which waits for each layer before reading it.

Placement: vLLM's CPU worker binds its threads, and so every thread they start, to the engine's
cores. The saver, the store's L2 writers and asynchronous loaders move to `background_cpus`
(default: the CPUs the engine is not bound to), so saving never takes the engine's core; their
CPU time is counted (`save_cpu_seconds`, the store's `l2_write_cpu_seconds`). They keep the
engine's priority: vLLM keeps stepping (busy) while a finished request's save is pending, so a
niced saver starves behind the very engines that wait for it. Synchronous loaders stay on the
engine's cores: the engine waits for them. The copier runs on `background_cpus`: on the
engine's cores it would take turns with the forward pass instead of running beside it.

Timing: each load reports its phases (queue: from the scheduler's plan to the loader's start;
open, read, checksum: the L2 reads; copy: into the engine's blocks before the forward;
layer_wait: the forward waiting for the layered copy) to `ConnectorCounters`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from typing import Any

import torch

from kvtier.core.clock import deadline_in, seconds_left
from kvtier.core.codec import BlockMeta
from kvtier.core.daemon_pool import DaemonPool
from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash
from kvtier.core.store import LoadedBlock
from kvtier.core.tiers.base import ReadTimes, Tier
from kvtier.core.tiers.posix import OpenedBlock
from kvtier.vllm.compat import EngineGeometry
from kvtier.vllm.layered_copy import LayeredCopy, Pending, PendingRead
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMeta, LoadSpec, SaveSpec
from kvtier.vllm.process_store import ProcessStore
from kvtier.vllm.settings import parse_cpu_list
from kvtier.vllm.stats import ConnectorCounters
from kvtier.vllm.transfer import PagedKV, host_bytes, payload_view

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0
"""How long `close` waits for the loads, copies and saves in progress (a save into L1 ends
soon; a read stuck in a hung mount may never end)."""

_NOTHING_TO_SAVE: Future[None] = Future()
"""The job of a save dropped past the backlog: already done."""
_NOTHING_TO_SAVE.set_result(None)


def background_cpus(setting: str | None) -> set[int] | None:
    """The CPUs of `ConnectorSettings.background_cpus`, resolved in the calling thread (the
    worker's, bound like the engine's); None: leave background threads where they start."""
    if setting == "inherit":
        return None
    if setting is not None:
        return parse_cpu_list(setting)
    others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    return others or None


def thread_placer(cpus: set[int] | None) -> Callable[[], None] | None:
    """A thread initializer moving the calling thread to `cpus` (Linux: it applies to the
    calling thread only); None when there is nothing to change."""
    if cpus is None:
        return None

    def place() -> None:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:  # e.g. CPUs outside this container's cpuset
            log.warning("kvtier: could not place a background thread on CPUs %s: %s", cpus, exc)

    return place


class _LayoutMismatch(Exception):
    """A stored block's layout is not this engine's (stops the load; the rest is recomputed)."""


class _Settled(Exception):
    """The load was settled (its deadline passed): it must not write another block."""


class _LoadRun:
    """One load's progress, shared by its loader thread and the deadline that may settle it."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.queued_at = time.monotonic()
        self._lock = threading.Lock()
        self.written = 0
        """Engine block ids of `spec` written so far, or handed to the layered copy (only the
        loader thread changes it)."""
        self.deferred: list[Pending] = []
        """Blocks for the step's layered copy."""
        self._settled = False

    def write(self, n_ids: int, scatter: Callable[[], None]) -> None:
        """Run `scatter` (writing the next `n_ids` engine blocks) unless settled."""
        with self._lock:
            if self._settled:
                raise _Settled
            scatter()
            self.written += n_ids

    def defer(self, pending: Pending) -> None:
        """Hand the next engine blocks to the layered copy unless settled."""
        with self._lock:
            if self._settled:
                raise _Settled
            self.deferred.append(pending)
            self.written += len(pending.engine_block_ids)

    def take_deferred(self) -> list[Pending]:
        """The blocks handed to the layered copy (once settled, no more are added)."""
        with self._lock:
            return list(self.deferred)

    def settle(self) -> tuple[int, ...] | None:
        """The engine block ids never written, the first time; None once already settled."""
        with self._lock:
            if self._settled:
                return None
            self._settled = True
            return tuple(self.spec.engine_block_ids[self.written :])


class _SaveRun:
    """One save: its job on the saver thread, and the preemption that may stop its reads of
    engine blocks."""

    def __init__(self, spec: SaveSpec, job: Future[None] = _NOTHING_TO_SAVE) -> None:
        self.spec = spec
        self.job = job
        self._lock = threading.Lock()
        self._dropped = False

    def gather(self, read: Callable[[], None]) -> bool:
        """Run `read` (copying engine blocks out) unless dropped; whether it ran."""
        with self._lock:
            if self._dropped:
                return False
            read()
            return True

    def drop(self) -> None:
        """No engine block is read after this returns (a read under way finishes first)."""
        with self._lock:
            self._dropped = True


class WorkerSide:
    def __init__(
        self,
        shared: ProcessStore,
        geometry: EngineGeometry,
        tp_rank: int,
        block_tokens: int,
        load_threads: int,
        counters: ConnectorCounters,
        *,
        cpus: set[int] | None = None,
        loads_in_background: bool = False,
        save_backlog_blocks: int = 256,
        load_staging: bool = True,
        load_read_threads: int = 0,
        load_deadline_s: float = 2.0,
        load_layerwise: bool | None = None,
        batches_in_flight: int = 1,
        ranks_union: Callable[[set[int]], set[int]] | None = None,
    ) -> None:
        """`cpus`: where background threads run (`background_cpus`); asynchronous loads run
        there too when `loads_in_background`. `load_staging`, `load_read_threads`,
        `load_deadline_s`, `load_layerwise`: see `ConnectorSettings`. `batches_in_flight`:
        `compat.batches_in_flight` (how many steps' failed loads bar saves). `ranks_union`:
        with tensor parallelism, the union over the ranks of a set each gives
        (`compat.tensor_parallel_union`, a collective)."""
        self._ranks_union = ranks_union
        self._shared = shared
        self._rank = tp_rank
        self._store = shared.store
        self._geometry = geometry
        self._block = block_tokens
        self._per_block = block_tokens // geometry.engine_block_tokens
        self._counters = counters
        self._kv: PagedKV | None = None
        self._pinned_save_buffer: torch.Tensor | None = None  # CUDA only; the saver's
        self._local = threading.local()  # per loader thread: its staging buffer
        self._loader = DaemonPool(
            load_threads, "kvtier-load", thread_placer(cpus) if loads_in_background else None
        )
        # Readers of synchronous loads may use every CPU: the engine waits for them.
        reader_cpus = (
            cpus if loads_in_background or cpus is None else cpus | os.sched_getaffinity(0)
        )
        self._read_threads = load_read_threads
        self._readers = (
            DaemonPool(load_read_threads, "kvtier-read", thread_placer(reader_cpus))
            if load_read_threads > 0 and load_staging
            else None
        )
        self._saver = DaemonPool(1, "kvtier-save", thread_placer(cpus))
        self._copier = DaemonPool(1, "kvtier-copy", thread_placer(cpus))
        spare = cpus is not None and bool(cpus - os.sched_getaffinity(0))
        self._layerwise = spare if load_layerwise is None else load_layerwise
        """The layered copy (`load_layerwise`; unset: where the copier has a core of its own:
        this thread is bound like the engine's)."""
        self._layered: LayeredCopy | None = None
        """This step's layered copy (only the worker's execute thread uses it)."""
        self._layered_until = 0.0
        """Its deadline (monotonic): the step's earliest load start plus `load_deadline_s`."""
        self._forward_waits: list[int | None] = []
        """The layers the forward pass waited for this step (None: an unknown layer name,
        waited for as every layer)."""
        self._backlog_limit = save_backlog_blocks
        self._load_staging = load_staging
        self._deadline_s = load_deadline_s
        self._lock = threading.Lock()
        # All below guarded by _lock.
        self._loads_done: set[str] = set()
        self._load_errors: set[int] = set()
        self._unwritten: set[int] = set()
        """Engine blocks this step's synchronous loads left unwritten: vLLM recomputes them
        in a later step, so this step's saves must not copy them (nor what follows them)."""
        self._recent_unwritten: deque[set[int]] = deque(maxlen=batches_in_flight)
        """`_unwritten` of the last `batches_in_flight` steps (execute thread only): the
        steps scheduled before vLLM saw a failed load computed on its stale blocks too."""
        self._async_loads: dict[str, _LoadRun] = {}
        self._save_runs: dict[str, list[_SaveRun]] = {}
        self._finishing: set[str] = set()
        self._backlog = 0
        """Blocks of the save jobs queued or running."""
        if self._store.config.l2_path is not None and not self._store.l2_enabled:
            counters.add(l2_unavailable=1)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv = PagedKV(kv_caches, self._per_block)
        g = self._geometry
        elements = 1
        for d in kv.layout.engine_block_shape:
            elements *= d
        expected = 2 * g.kv_heads * g.engine_block_tokens * g.head_size
        if (
            kv.layout.num_layers != g.num_layers
            or elements != expected
            or kv.layout.dtype_name != g.dtype
        ):
            raise ConfigError(
                f"kv_caches: {kv.layout.num_layers} layers of {kv.layout.engine_block_shape} "
                f"{kv.layout.dtype_name} per block do not match the namespace geometry {g}"
            )
        self._kv = kv
        log.info(
            "kvtier: registered %d KV layers, %d engine blocks, %d bytes per kvtier block",
            kv.layout.num_layers,
            kv.num_engine_blocks,
            kv.layout.payload_bytes,
        )

    # ---- per step -----------------------------------------------------------------------

    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """Drop the saves of preempted requests (vLLM frees their blocks) and forget them: a
        request is reported finished sending only for saves planned after it resumed (the
        scheduler side no longer counts the dropped ones either)."""
        with self._lock:
            runs = [run for r in meta.preempted for run in self._save_runs.pop(r, ())]
        for run in runs:
            run.drop()

    def start_loads(self, meta: KvtierMetadata) -> None:
        """Queue asynchronous loads; run synchronous ones to completion or to their deadline
        (this step's forward pass reads them)."""
        sync: dict[Future[None], _LoadRun] = {}
        # the blocks may have held other requests' KV, which queued forward passes still read
        after = self._require_kv().forward_mark() if meta.loads else None
        for spec in meta.loads:
            run = _LoadRun(spec)
            if spec.asynchronous:
                with self._lock:
                    self._async_loads[spec.req_id] = run
                self._loader.submit(self._load, run, after)
            else:
                sync[self._loader.submit(self._load, run, after)] = run
        if sync:
            _, late = wait(sync, timeout=self._deadline_s)
            for future in late:
                self._settle(sync[future], missed_deadline=True)
            pending = [p for run in sync.values() for p in run.take_deferred()]
            started = min(run.queued_at for run in sync.values())
            self._start_layered(pending, started + self._deadline_s)

    def _start_layered(self, pending: list[Pending], until: float) -> None:
        if not pending:
            return
        job = self._layered = LayeredCopy(self._require_kv(), pending)
        self._layered_until = until
        self._forward_waits = []
        try:
            self._copier.submit(job.run)
        except RuntimeError:  # closed: copy here
            job.run()

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once the layer `layer_name` of this step's layered copy is written."""
        job = self._layered
        if job is None:
            return
        layer = self._require_kv().layer_index.get(layer_name)
        self._forward_waits.append(layer)
        self._wait_layered(job, layer)

    def _wait_layered(self, job: LayeredCopy, layer: int | None) -> None:
        """Wait for `layer` of `job` (None: all of it) until its deadline, then settle it."""
        if job.settled:  # past its deadline: the forward goes on, its output is dropped
            return
        start = time.perf_counter()
        if not job.wait(layer, self._layered_until):
            job.settle()
            self._counters.add(load_deadline_missed=1)
            log.warning(
                "kvtier: a layered copy missed the load deadline; its blocks are recomputed"
            )
        waited = time.perf_counter() - start
        if waited > 1e-6:
            self._counters.add(phase_layer_wait_seconds=waited)

    def _end_layered(self) -> None:
        """Wait for this step's layered copy. A failed one, or one the forward pass did not
        wait for layer by layer (it may have read blocks not yet written), is reported as
        failed loads; the latter also turns the layered copy off for good."""
        job, self._layered = self._layered, None
        if job is None:
            return
        self._wait_layered(job, None)
        self._counters.add(layered_copy_seconds=job.copy_s)
        waits = self._forward_waits
        layers = self._require_kv().layout.num_layers
        unguarded = not (waits and waits[0] is None) and not set(range(layers)) <= set(waits)
        if unguarded and self._layerwise:
            self._layerwise = False
            log.warning(
                "kvtier: the forward pass did not wait for every layer of a layered copy (%d "
                "of %d); its blocks are recomputed, and hits are copied before the forward "
                "from now on",
                len(set(waits)),
                layers,
            )
        failed = job.engine_block_ids if unguarded else job.failed
        if failed:
            self._counters.add(load_failed_blocks=len(failed))
            with self._lock:
                self._load_errors.update(failed)
                self._unwritten.update(failed)

    def submit_saves(self, meta: KvtierMetadata) -> None:
        self._end_layered()
        with self._lock:
            unwritten, self._unwritten = self._unwritten, set()
        if self._ranks_union is not None and any(not load.asynchronous for load in meta.loads):
            # one rank's stale block taints every rank's forward pass (its attention output is
            # all-reduced): every rank bars the saves a failed load on any rank taints. Every
            # rank gets the same loads, so all take part in this collective in the same steps.
            unwritten = self._ranks_union(unwritten)
        self._recent_unwritten.append(unwritten)
        stale = set[int]().union(*self._recent_unwritten)
        dropped = 0
        after = self._require_kv().forward_mark() if meta.saves else None  # (queued, not run)
        for spec in meta.saves:
            if stale:
                spec = spec.head(self._written_blocks(spec, stale), self._per_block)
            todo = self._to_save(spec)
            run = _SaveRun(spec)
            if self._charge(len(todo)):
                run.job = self._saver.submit(self._save, run, todo, after)
                run.job.add_done_callback(functools.partial(self._save_done, n_blocks=len(todo)))
            else:
                dropped += len(todo)
            # every request with a save spec (even an empty or dropped one) gets a job: vLLM
            # frees its blocks only once it is reported finished
            with self._lock:
                self._save_runs.setdefault(spec.req_id, []).append(run)
        if dropped:
            self._counters.add(save_dropped_blocks=dropped)

    def _to_save(self, spec: SaveSpec) -> tuple[int, ...]:
        """Positions in `spec` of the blocks to copy out: those this rank's L1 lacks, but, with
        L1 off, those the request loaded from L2 (`promote`: L2 holds them). L2 is never asked
        (a stalled mount would hold the saver, and with it finished requests' engine blocks):
        a computed block L2 holds already (another replica's) is copied into L1 and offered
        to L2 again, where the write-behind or the tier's `put` finds it (`already_present`:
        a directory checks before writing, Valkey's SET NX refuses it) and writes nothing.
        That costs a copy where an L2 check would have skipped it; the common case, a block
        this replica computed first, has to be written anyway."""
        l1_on = self._store.config.l1_bytes > 0
        return tuple(
            i
            for i, block_hash in enumerate(spec.hashes)
            if not self._store.in_l1(block_hash) and (l1_on or i not in spec.promote)
        )

    def _charge(self, n_blocks: int) -> bool:
        """Add `n_blocks` to the saver's backlog unless that passes `save_backlog_blocks`."""
        with self._lock:
            if self._backlog + n_blocks > self._backlog_limit:
                return False
            self._backlog += n_blocks
            return True

    def _written_blocks(self, spec: SaveSpec, stale: set[int]) -> int:
        """How many leading blocks of `spec` hold KV computed from loaded or computed KV only:
        a block a recent step failed to load holds stale KV, and the forward passes that read
        it (before vLLM recomputed it) computed what follows it from that, in this request or
        in another that shares the block (`loaded_before`)."""
        if not stale.isdisjoint(spec.loaded_before):
            return 0
        p = self._per_block
        for i in range(len(spec.hashes)):
            if not stale.isdisjoint(spec.engine_block_ids[i * p : (i + 1) * p]):
                return i
        return len(spec.hashes)

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        expired = time.monotonic() - self._deadline_s
        with self._lock:
            late = [r for r in self._async_loads.values() if r.queued_at < expired]
        for run in late:
            self._settle(run, missed_deadline=True)
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._save_runs)
            sending = {
                r for r in self._finishing if all(run.job.done() for run in self._save_runs[r])
            }
            for r in sending:
                self._finishing.discard(r)
                del self._save_runs[r]
            recving, self._loads_done = self._loads_done, set()
        return sending or None, recving or None

    def worker_meta(self) -> KvtierWorkerMeta | None:
        """This worker's L1 changes since the last step, for the scheduler's L1 mirror."""
        changes = self._shared.take_l1_changes()
        return KvtierWorkerMeta([(self._rank, c) for c in changes]) if changes else None

    def load_errors(self) -> set[int]:
        self._end_layered()  # (vLLM may ask before `wait_for_save`)
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Cancel queued loads, let queued saves and copies run, and wait for the threads up to
        `timeout_s` in all; threads stuck in a hung mount are left behind (they are daemons:
        they never keep the process alive)."""
        pools = [self._loader, self._copier, self._saver]
        self._loader.shutdown(wait=False, cancel_futures=True)
        if self._readers is not None:
            self._readers.shutdown(wait=False, cancel_futures=True)
            pools.append(self._readers)
        self._copier.shutdown(wait=False)
        self._saver.shutdown(wait=False)
        deadline = deadline_in(timeout_s)
        for pool in pools:
            pool.join(seconds_left(deadline))

    # ---- background threads -------------------------------------------------------------

    def _load(self, run: _LoadRun, after: Any) -> None:
        """Loader thread: read the blocks, write them into the request's engine blocks once the
        work `after` (`PagedKV.forward_mark`) marks is done."""
        spec = run.spec
        start = time.perf_counter()
        queued = 0.0 if spec.planned_at is None else max(0.0, time.monotonic() - spec.planned_at)
        p = self._per_block
        self._alias(spec.hashes, spec.engine_hashes)
        counts = {Tier.L1: 0, Tier.L2: 0}
        loaded_bytes = 0
        times = ReadTimes()
        copy_s = 0.0

        def consume(block: LoadedBlock | OpenedBlock) -> None:
            """Copy `block` into the engine's blocks, or hand it to the layered copy."""
            nonlocal loaded_bytes, copy_s
            # (an opened block's header comes with its first piece: the copy checks it then)
            if block.meta is not None and not kv.layout.matches(block.meta):
                log.warning(
                    "kvtier: block %s has layout %s %s, expected %s %s",
                    block.block_hash.hex(),
                    block.meta.shape,
                    block.meta.dtype,
                    kv.layout.shape,
                    kv.layout.dtype_name,
                )
                raise _LayoutMismatch
            skip = spec.skip if counts[Tier.L1] + counts[Tier.L2] == 0 else 0
            ids = spec.engine_block_ids[run.written : run.written + p - skip]
            if isinstance(block, OpenedBlock):  # read layer by layer beside the forward
                kv.check_scatter(ids, skip)
                run.defer(PendingRead(block, tuple(ids), skip))
                tier, nbytes = Tier.L2, block.payload_bytes
            else:
                src = payload_view(block.payload, kv.layout)
                if layered and block.tier is Tier.L1:  # L1's views stay valid: copied later
                    run.defer(kv.pending_scatter(src, ids, skip))
                else:
                    t = time.perf_counter()
                    run.write(len(ids), lambda: kv.scatter(src, ids, skip, after))
                    copy_s += time.perf_counter() - t
                tier, nbytes = block.tier, block.payload.nbytes
            counts[tier] += 1
            loaded_bytes += nbytes

        try:
            kv = self._require_kv()
            layered = self._layerwise and not spec.asynchronous and kv.device.type == "cpu"
            if layered and self._store.piece_reads:
                opened = self._store.open_pieces(
                    spec.hashes, kv.layout.payload_bytes, pool=self._readers, times=times
                )
                self._hand_over(opened, consume)
            else:
                staging = self._staging(kv) if self._load_staging else []
                self._store.load_into(
                    spec.hashes, consume, staging=staging, pool=self._readers, times=times
                )
        except (_LayoutMismatch, _Settled):
            pass
        except Exception:
            log.exception("kvtier: load for request %s failed", spec.req_id)
        elapsed = time.perf_counter() - start
        self._counters.add(
            load_blocks_l1=counts[Tier.L1],
            load_blocks_l2=counts[Tier.L2],
            load_bytes=loaded_bytes,
            load_seconds=elapsed,
            load_max_seconds=elapsed,
            phase_queue_seconds=queued,
            phase_open_seconds=times.open_s,
            phase_read_seconds=times.read_s,
            phase_checksum_seconds=times.checksum_s,
            phase_copy_seconds=copy_s,
        )
        self._settle(run, missed_deadline=False)

    @staticmethod
    def _hand_over(
        blocks: list[LoadedBlock | OpenedBlock],
        consume: Callable[[LoadedBlock | OpenedBlock], None],
    ) -> None:
        """`consume` each block in order; the opened files it did not take are closed."""
        taken = 0
        try:
            for block in blocks:
                consume(block)
                taken += 1
        finally:
            for block in blocks[taken:]:
                if isinstance(block, OpenedBlock):
                    block.abandon()

    def _settle(self, run: _LoadRun, *, missed_deadline: bool) -> None:
        """Report `run`'s unwritten blocks as failed and, if asynchronous, its completion (once:
        by its loader when it ends, or by the deadline if that comes first)."""
        failed = run.settle()
        if failed is None:
            return
        spec = run.spec
        self._counters.add(
            load_failed_blocks=len(failed), load_deadline_missed=int(missed_deadline)
        )
        if failed:
            log.warning(
                "kvtier: request %s: %d of %d engine blocks %s; vLLM recomputes them",
                spec.req_id,
                len(failed),
                len(spec.engine_block_ids),
                "missed the load deadline" if missed_deadline else "failed to load",
            )
        with self._lock:  # errors and completion become visible together
            self._load_errors.update(failed)
            if not spec.asynchronous:
                self._unwritten.update(failed)
            if spec.asynchronous:
                self._async_loads.pop(spec.req_id, None)
                self._loads_done.add(spec.req_id)

    def _staging(self, kv: PagedKV) -> list[memoryview]:
        """This loader thread's staging buffers (one payload each, allocated once, reused): one
        per read in flight, plus the one being copied into vLLM's cache."""
        buffers: list[torch.Tensor] | None = getattr(self._local, "staging", None)
        if buffers is None:
            n = 1 if self._readers is None else self._read_threads + 1
            buffers = self._local.staging = [kv.new_host_buffer() for _ in range(n)]
        return [host_bytes(b) for b in buffers]

    def _save(self, run: _SaveRun, todo: tuple[int, ...], after: Any) -> None:
        """Saver thread: copy out and offer the blocks of the save at positions `todo`
        (`_to_save`) that L1 still lacks, until the request is preempted; each once the work
        `after` (`PagedKV.forward_mark`: the forward pass computing them) marks is done."""
        start, cpu = time.perf_counter(), time.thread_time()
        spec = run.spec
        p = self._per_block
        self._alias(spec.hashes, spec.engine_hashes)
        saved = rejected = failed = dropped = 0
        skipped = len(spec.hashes) - len(todo)
        try:
            kv = self._require_kv()
            # On CPU each block gets a fresh buffer that L1 adopts (one copy, not two); pinned
            # CUDA staging is too costly to allocate per block, so it is reused and copied.
            adopt = kv.device.type == "cpu"
            for k, i in enumerate(todo):
                block_hash = spec.hashes[i]
                if self._store.in_l1(block_hash):  # saved since it was queued (another request)
                    skipped += 1
                    continue
                index = spec.first_index + i
                buffer = kv.new_host_buffer() if adopt else self._pinned_buffer(kv)
                ids = spec.engine_block_ids[i * p : (i + 1) * p]
                if not run.gather(functools.partial(kv.gather, ids, buffer, after)):
                    dropped = len(todo) - k  # preempted: its blocks are reused now
                    break
                meta = BlockMeta(
                    num_tokens=self._block,
                    dtype=kv.layout.dtype_name,
                    shape=kv.layout.shape,
                    parent=spec.parents[i],
                )
                if self._store.save(
                    block_hash,
                    meta,
                    host_bytes(buffer),
                    reused=index < spec.reused_blocks,
                    prefix_tokens=(index + 1) * self._block,
                    adopt=adopt,
                ):
                    saved += 1
                else:
                    rejected += 1
        except Exception:
            failed = len(spec.hashes) - saved - skipped - rejected - dropped
            log.exception("kvtier: save for request %s failed", spec.req_id)
        nbytes = saved * (self._kv.layout.payload_bytes if self._kv is not None else 0)
        self._counters.add(
            save_blocks=saved,
            save_bytes=nbytes,
            save_seconds=time.perf_counter() - start,
            save_cpu_seconds=time.thread_time() - cpu,
            save_skipped_blocks=skipped,
            save_rejected_blocks=rejected,
            save_failed_blocks=failed,
            save_dropped_blocks=dropped,
        )

    def _save_done(self, future: Future[None], *, n_blocks: int) -> None:
        with self._lock:
            self._backlog -= n_blocks

    def _pinned_buffer(self, kv: PagedKV) -> torch.Tensor:
        if self._pinned_save_buffer is None:
            self._pinned_save_buffer = kv.new_host_buffer()
        return self._pinned_save_buffer

    def _alias(self, hashes: tuple[BlockHash, ...], engine_hashes: tuple[BlockHash, ...]) -> None:
        if not engine_hashes:
            return
        p = self._per_block
        for i, block_hash in enumerate(hashes):
            self._shared.aliases.add(block_hash, engine_hashes[i * p : (i + 1) * p])

    def _require_kv(self) -> PagedKV:
        if self._kv is None:
            raise RuntimeError("kvtier: KV caches were never registered")
        return self._kv
