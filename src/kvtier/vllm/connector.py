"""`KvtierConnector`: kvtier's tiered store under vLLM's prefix cache, as a `KVConnectorBase_V1`.

Loaded by vLLM from the transfer config (one instance in the scheduler, one per worker):

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l1_bytes": 4294967296, "l2_path": "/mnt/kv"}}'

This class only routes vLLM's hooks: scheduler-role hooks to `SchedulerSide`, worker-role hooks
to `WorkerSide`, counters to `stats`. Loads are synchronous by default (read before the forward
pass of the step that computes the rest of the prompt; L1 hits, and L2 hits from a local
directory, copied layer by layer during it)
or asynchronous (a hit waits in vLLM's WAITING_FOR_REMOTE_KVS while a worker thread fills its
blocks), saves run on a worker thread after the forward pass, and a request with saves in
flight keeps its blocks until they finish.
Failed loads are reported by engine block id; with `kv_load_failure_policy: "recompute"` vLLM
recomputes them (with vLLM's default "fail" the request fails).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvtier.core.tiers.base import Tier
from kvtier.vllm import compat, process_store
from kvtier.vllm.compat import (
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
)
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMeta
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.settings import ConnectorSettings
from kvtier.vllm.stats import ConnectorCounters, KvtierPromMetrics, KvtierStats
from kvtier.vllm.worker_side import WorkerSide, background_cpus, thread_placer

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvtierConnector"]

log = logging.getLogger(__name__)

_HIT_SOURCE = {Tier.L1: CacheHitSource.HOST, Tier.L2: CacheHitSource.DISK}


class KvtierConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by kvtier's L1 (host memory) and L2 (shared pool)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_version()
        compat.check_kv_cache_layout(kv_cache_config)
        compat.check_pipeline(vllm_config)
        self.config = ConnectorSettings.from_sources(compat.extra_config(vllm_config))
        geometry = compat.engine_geometry(vllm_config)
        block_tokens = process_store.block_tokens(self.config, geometry)
        model = compat.model_path(vllm_config)
        self.counters = ConnectorCounters()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._stores = [
                process_store.acquire(
                    self.config,
                    process_store.model_identity(self.config, geometry, model, rank),
                    publish=False,
                )
                for rank in range(geometry.tp_size)
            ]
            self._scheduler = SchedulerSide(
                self._stores,
                block_tokens,
                geometry.engine_block_tokens,
                self.config.lookup_ttl_s,
                self.counters,
                lookup_wait_s=self.config.lookup_wait_ms / 1000,
                events=self.config.events_endpoint is not None,
                block_ids_of=self._block_ids_of,
                load_async=self.config.load_async,
                lookup_deadline_s=self.config.load_deadline_s,
                batches_in_flight=compat.batches_in_flight(vllm_config),
            )
        else:
            rank = compat.worker_tp_rank()
            identity = process_store.model_identity(self.config, geometry, model, rank)
            cpus = background_cpus(self.config.background_cpus)
            self._stores = [
                process_store.acquire(
                    self.config,
                    identity,
                    publish=rank == 0,
                    thread_init=thread_placer(cpus),
                )
            ]
            self._worker = WorkerSide(
                self._stores[0],
                geometry,
                rank,
                block_tokens,
                self.config.load_threads,
                self.counters,
                cpus=cpus,
                loads_in_background=self.config.load_async,
                save_backlog_blocks=self.config.save_backlog_blocks,
                load_staging=self.config.load_staging,
                load_read_threads=self.config.load_read_threads,
                load_deadline_s=self.config.load_deadline_s,
                load_layerwise=self.config.load_layerwise,
                batches_in_flight=compat.batches_in_flight(vllm_config),
                ranks_union=compat.tensor_parallel_union(),
            )
        self.counters.watch(
            (s.store for s in self._stores),
            source=role.name.lower(),
            publishers=(s.publisher for s in self._stores if s.publisher is not None),
        )
        log.info(
            "kvtier connector (%s): namespace %s, %d-token blocks, L1 %d bytes, L2 %s",
            role.name,
            [r.namespace for r in self._stores],
            block_tokens,
            self.config.l1_bytes,
            self.config.l2_path,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, not a lost hand-off

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KvtierMetadata):
            self._worker_side().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are copied after the forward pass, in `wait_for_save`

    def wait_for_save(self) -> None:
        self._worker_side().submit_saves(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side().worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.counters.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        for rt in self._stores:
            process_store.release(rt)
        self._stores = []

    # ---- scheduler side -------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        by_tier = self._scheduler_side().hit_tokens(request)
        sources = {_HIT_SOURCE[t]: n for t, n in by_tier.items() if n}
        if sum(sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMeta):
            self._scheduler_side().apply_worker_meta(meta)
        failed = connector_output.invalid_block_ids
        if failed and self._kv_cache_manager is not None:
            # vLLM (`recompute` policy) keeps a block that failed to load in its prefix cache,
            # where it cached it for the load, and the blocks computed from it in that step,
            # until their request recomputes them; a request aborted or preempted first would
            # leave their stale KV there for later L0 hits
            stale = self._scheduler_side().computed_from(set(failed))
            self._kv_cache_manager.evict_blocks(stale)

    def reset_cache(self) -> bool:
        """The weights may have changed (RLHF weight sync): never load what was cached before."""
        self._scheduler_side().reset()
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().finished(request), None

    def take_events(self) -> Iterable[Any]:
        return ()  # kvtier publishes its own events (kvtier.net.kv_events), keyed seedlessly

    # ---- stats ------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvtierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- helpers ----------------------------------------------------------------------------

    def _block_ids_of(self, req_id: str) -> list[int]:
        if self._kv_cache_manager is None:
            raise RuntimeError("kvtier: vLLM never bound its KV cache manager")
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def _meta(self) -> KvtierMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierMetadata):
            raise TypeError(f"kvtier: unexpected connector metadata {type(meta).__name__}")
        return meta

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvtier: worker hook called on the scheduler-side connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("kvtier: scheduler hook called on the worker-side connector")
        return self._scheduler
