"""Connector statistics through vLLM's hooks: per-step deltas, log lines and Prometheus counters.

`ConnectorCounters` is filled by the worker's background threads and by the scheduler thread;
`take()` (called each step by vLLM through `get_kv_connector_stats`) returns the deltas since
the last call as a `KvtierStats`. vLLM sends worker stats to the scheduler, aggregates them with
the scheduler's own, logs `reduce()` periodically, and feeds `observe()` of `KvtierPromMetrics`,
which exports each counter as `kvtier:<name>_total` on the server's `/metrics`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvtier.vllm.compat import KVConnectorPromMetrics, KVConnectorStats

COUNTERS: dict[str, str] = {
    "hit_tokens_l1": "Prompt tokens the scheduler planned to load from L1 (host memory).",
    "hit_tokens_l2": "Prompt tokens the scheduler planned to load from L2 (shared pool).",
    "load_blocks_l1": "kvtier blocks loaded from L1 into vLLM's KV cache.",
    "load_blocks_l2": "kvtier blocks loaded from L2 into vLLM's KV cache.",
    "load_bytes": "Payload bytes loaded into vLLM's KV cache.",
    "load_seconds": "Wall time of block loads (store read + copy into the KV cache).",
    "load_failed_blocks": "Engine blocks that failed to load and were recomputed by vLLM.",
    "save_blocks": "kvtier blocks admitted by the store.",
    "save_bytes": "Payload bytes admitted by the store.",
    "save_seconds": "Wall time of saves (copy out of the KV cache + store put).",
    "save_skipped_blocks": "Computed blocks not saved because the store already had them.",
    "save_rejected_blocks": "Blocks the admission policy refused.",
    "save_failed_blocks": "Blocks whose copy out of the KV cache failed.",
    "l2_unavailable": "1 when an L2 path is configured but unusable (the store runs L1-only).",
}
MAXIMA: dict[str, str] = {
    "load_max_seconds": "Slowest single request load in the interval.",
}


@dataclass
class KvtierStats(KVConnectorStats):
    """Counter deltas of one interval (`data`: name -> number)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        for name, value in other.data.items():
            if name in MAXIMA:
                self.data[name] = max(self.data.get(name, 0.0), value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if v}
        loads = self.data.get("load_blocks_l1", 0) + self.data.get("load_blocks_l2", 0)
        if loads:
            out["load_ms_per_block"] = round(1000 * self.data["load_seconds"] / loads, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ConnectorCounters:
    """Thread-safe accumulators; `take()` hands out and clears the deltas."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                if name in MAXIMA:
                    self._data[name] = max(self._data.get(name, 0.0), value)
                    self._totals[name] = max(self._totals.get(name, 0.0), value)
                else:
                    self._data[name] = self._data.get(name, 0) + value
                    self._totals[name] = self._totals.get(name, 0) + value

    def take(self) -> KvtierStats | None:
        with self._lock:
            data, self._data = self._data, {}
        return KvtierStats(data=data) if any(data.values()) else None

    def totals(self) -> dict[str, float]:
        """Everything counted since start (for tests and `kvtier` tools)."""
        with self._lock:
            return dict(self._totals)


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of `COUNTERS`, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(
                name=f"kvtier:{name}", documentation=doc, labelnames=labelnames
            )
            self._counters[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
