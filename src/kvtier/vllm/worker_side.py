"""Worker-side connector: moves blocks between the store and vLLM's paged KV cache.

Runs in each worker (one per TP rank). vLLM calls, on the worker's execute thread, per step:

    handle_preemptions(meta)   before the step: waits for pending saves of preempted requests
                               (their blocks are about to be reused).
    start_loads(meta)          queues this step's loads on the loader thread(s) and returns
                               (synchronous loads, if configured, are waited for here).
    submit_saves(meta)         after the forward (`wait_for_save`): queues this step's saves on
                               the saver thread and returns; the forward pass never waits.
    finished(ids)              requests whose loads completed, and finished requests whose
                               saves completed (vLLM holds their blocks until then).
    load_errors()              engine block ids that failed to load (vLLM recomputes them).
    worker_meta()              blocks that entered or left this rank's L1 (the scheduler may
                               run in another process and mirrors L1 from these reports).

Background threads (owned here, stopped by `close`):
- loader: `store.load` (L1 hit, or L2 read + validation + promotion), then `scatter` into the
  request's engine blocks (allocated to it alone while it waits for the load);
- saver: for each newly completed block not yet in the store, `gather` its engine blocks into a
  host buffer and `store.save` it (copied into L1; written through to L2 asynchronously).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvtier.core.codec import BlockMeta
from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import Tier
from kvtier.vllm.compat import EngineGeometry
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMeta, LoadSpec, SaveSpec
from kvtier.vllm.process_store import ProcessStore
from kvtier.vllm.stats import ConnectorCounters
from kvtier.vllm.transfer import PagedKV, host_bytes, payload_view

log = logging.getLogger(__name__)

PREEMPT_WAIT_S = 30.0


class WorkerSide:
    def __init__(
        self,
        shared: ProcessStore,
        geometry: EngineGeometry,
        tp_rank: int,
        block_tokens: int,
        load_threads: int,
        counters: ConnectorCounters,
    ) -> None:
        self._shared = shared
        self._rank = tp_rank
        self._store = shared.store
        self._geometry = geometry
        self._block = block_tokens
        self._per_block = block_tokens // geometry.engine_block_tokens
        self._counters = counters
        self._kv: PagedKV | None = None
        self._save_buffer: torch.Tensor | None = None  # only the saver thread uses it
        self._loader = ThreadPoolExecutor(load_threads, thread_name_prefix="kvtier-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        self._lock = threading.Lock()
        # All below guarded by _lock.
        self._loads_done: set[str] = set()
        self._load_errors: set[int] = set()
        self._save_jobs: dict[str, list[Future[None]]] = {}
        self._finishing: set[str] = set()
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
        with self._lock:
            jobs = [f for r in meta.preempted for f in self._save_jobs.get(r, ())]
        if jobs:
            wait(jobs, timeout=PREEMPT_WAIT_S)

    def start_loads(self, meta: KvtierMetadata) -> None:
        """Queue asynchronous loads; run synchronous ones to completion (this step's forward
        pass reads them)."""
        sync = [
            self._loader.submit(self._load, spec) for spec in meta.loads if not spec.asynchronous
        ]
        for spec in meta.loads:
            if spec.asynchronous:
                self._loader.submit(self._load, spec)
        wait(sync)

    def submit_saves(self, meta: KvtierMetadata) -> None:
        for spec in meta.saves:
            future = self._saver.submit(self._save, spec)
            with self._lock:
                self._save_jobs.setdefault(spec.req_id, []).append(future)

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._save_jobs)
            sending = {r for r in self._finishing if all(f.done() for f in self._save_jobs[r])}
            for r in sending:
                self._finishing.discard(r)
                del self._save_jobs[r]
            recving, self._loads_done = self._loads_done, set()
        return sending or None, recving or None

    def worker_meta(self) -> KvtierWorkerMeta | None:
        """This worker's L1 changes since the last step, for the scheduler's L1 mirror."""
        changes = self._shared.take_l1_changes()
        return KvtierWorkerMeta([(self._rank, c) for c in changes]) if changes else None

    def load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=True)

    # ---- background threads -------------------------------------------------------------

    def _load(self, spec: LoadSpec) -> None:
        """Loader thread: read the blocks, write them into the request's engine blocks."""
        start = time.perf_counter()
        p = self._per_block
        self._alias(spec.hashes, spec.engine_hashes)
        done_ids = 0  # engine block ids of spec written so far
        counts = {Tier.L1: 0, Tier.L2: 0}
        loaded_bytes = 0
        try:
            kv = self._require_kv()
            for i, block in enumerate(self._store.load(spec.hashes)):
                skip = spec.skip if i == 0 else 0
                if block.meta.shape != kv.layout.shape or block.meta.dtype != kv.layout.dtype_name:
                    log.warning(
                        "kvtier: block %s has layout %s %s, expected %s %s",
                        block.block_hash.hex(),
                        block.meta.shape,
                        block.meta.dtype,
                        kv.layout.shape,
                        kv.layout.dtype_name,
                    )
                    break
                ids = spec.engine_block_ids[done_ids : done_ids + p - skip]
                kv.scatter(payload_view(block.payload, kv.layout), ids, skip)
                done_ids += len(ids)
                counts[block.tier] += 1
                loaded_bytes += block.payload.nbytes
        except Exception:
            log.exception("kvtier: load for request %s failed", spec.req_id)
        failed = spec.engine_block_ids[done_ids:]
        elapsed = time.perf_counter() - start
        self._counters.add(
            load_blocks_l1=counts[Tier.L1],
            load_blocks_l2=counts[Tier.L2],
            load_bytes=loaded_bytes,
            load_seconds=elapsed,
            load_max_seconds=elapsed,
            load_failed_blocks=len(failed),
        )
        if failed:
            log.warning(
                "kvtier: request %s: %d of %d engine blocks failed to load; vLLM recomputes them",
                spec.req_id,
                len(failed),
                len(spec.engine_block_ids),
            )
        with self._lock:  # errors and completion become visible together
            self._load_errors.update(failed)
            if spec.asynchronous:
                self._loads_done.add(spec.req_id)

    def _save(self, spec: SaveSpec) -> None:
        """Saver thread: copy out and offer every block of `spec` the store does not hold."""
        start = time.perf_counter()
        p = self._per_block
        self._alias(spec.hashes, spec.engine_hashes)
        saved = skipped = rejected = failed = 0
        try:
            kv = self._require_kv()
            if self._save_buffer is None:
                self._save_buffer = kv.new_host_buffer()
            buffer = self._save_buffer
            for i, block_hash in enumerate(spec.hashes):
                if self._store.contains(block_hash) is not None:
                    skipped += 1
                    continue
                index = spec.first_index + i
                kv.gather(spec.engine_block_ids[i * p : (i + 1) * p], buffer)
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
                ):
                    saved += 1
                else:
                    rejected += 1
        except Exception:
            failed = len(spec.hashes) - saved - skipped - rejected
            log.exception("kvtier: save for request %s failed", spec.req_id)
        nbytes = saved * (self._kv.layout.payload_bytes if self._kv is not None else 0)
        self._counters.add(
            save_blocks=saved,
            save_bytes=nbytes,
            save_seconds=time.perf_counter() - start,
            save_skipped_blocks=skipped,
            save_rejected_blocks=rejected,
            save_failed_blocks=failed,
        )

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
