"""Connector statistics through vLLM's hooks: per-step deltas, log lines and Prometheus metrics.

`ConnectorCounters` is filled by the worker's background threads and by the scheduler thread
(`add`), and, at most once a second, from the process's stores and their L2 janitor (`watch`).
`take()` (called each step by vLLM through `get_kv_connector_stats`, in the scheduler and in
every worker) returns what changed since the last call as a `KvtierStats`. vLLM sends worker
stats to the scheduler, aggregates them with the scheduler's own, logs `reduce()` periodically,
and feeds `observe()` of `KvtierPromMetrics` in the API server, which exports the families of
`kvtier.vllm.connector_metrics` on the replica's `/metrics`.

The wire format (`KvtierStats.data`, msgpack-serializable) maps a key to a number: a counter
delta (summed), a gauge value, or, for the two latency histograms, the list of observations.
A gauge's key names its source process (`l1_used_bytes@worker`): with the worker in its own
process the scheduler's store is another one (no L1 of its own, its own janitor), and the
exported gauge is the maximum over sources of their latest values (also over TP ranks, which
hold equal shares of L1). Gauges only move while the engine steps: vLLM sends no stats while it
idles.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.core.tiers.janitor import read_status
from kvtier.vllm.compat import KVConnectorPromMetrics, KVConnectorStats
from kvtier.vllm.connector_metrics import (
    CONNECTOR_METRICS,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    L2_METRICS,
)

if TYPE_CHECKING:
    from kvtier.core.store import StoreStats, TieredStore
    from kvtier.net.kv_events import EventPublisher

__all__ = ["ConnectorCounters", "KvtierPromMetrics", "KvtierStats"]

MAXIMA = frozenset({"load_max_seconds"})
"""Log-only maxima (not exported: the histogram has the distribution)."""
MAX_OBSERVATIONS = 10_000
"""Observations one stats object carries per histogram at most (the rest are dropped)."""
SAMPLE_INTERVAL_S = 1.0
"""How often `take()` reads the watched stores."""
STATUS_INTERVAL_S = 5.0
"""How often the L2 janitor's status file is re-read."""


def _gauge(name: str) -> str | None:
    """The gauge a wire key sets (`l1_used_bytes@worker` -> its family), or None."""
    return GAUGES.get(name.partition("@")[0])


def _merge(data: dict[str, Any], name: str, value: Any) -> None:
    """Fold one wire value into `data` (the aggregation rule of its key)."""
    if name in HISTOGRAMS:
        kept: list[float] = data.setdefault(name, [])
        values = value if isinstance(value, list) else [value]
        kept.extend(values[: max(0, MAX_OBSERVATIONS - len(kept))])
    elif name in MAXIMA or _gauge(name) is not None:
        data[name] = max(data.get(name, value), value)
    else:
        data[name] = data.get(name, 0) + value


@dataclass
class KvtierStats(KVConnectorStats):
    """What changed in one interval (`data`: the wire format of the module docstring)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        for name, value in other.data.items():
            _merge(self.data, name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in self.data.items():
            if name in HISTOGRAMS:
                out[name] = round(sum(value), 6)
            elif value and _gauge(name) is None:
                out[name] = value
        loads = self.data.get("load_blocks_l1", 0) + self.data.get("load_blocks_l2", 0)
        if loads:
            out["load_ms_per_block"] = round(1000 * out["load_seconds"] / loads, 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


class ConnectorCounters:
    """Thread-safe accumulators; `take()` hands out and clears the deltas."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        self._totals: dict[str, float] = {}
        self._clock = clock
        self._samplers: list[_StoreSampler | _PublisherSampler] = []
        self._next_sample = 0.0

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                _merge(self._data, name, value)
                if name in MAXIMA or _gauge(name) is not None:
                    self._totals[name] = max(self._totals.get(name, value), value)
                else:
                    self._totals[name] = self._totals.get(name, 0) + value

    def watch(
        self,
        stores: Iterable[TieredStore],
        source: str,
        publishers: Iterable[EventPublisher] = (),
    ) -> None:
        """Report the stores' own counters and gauges (and their janitor's) and the event
        publishers' counts from now on, the gauges as coming from `source` (scheduler, worker).
        Each is reported by the first connector of its process that watches it (the scheduler
        and the worker share one store when they share a process)."""
        with _watched_lock:
            for store in stores:
                if store not in _watched:
                    _watched.add(store)
                    self._samplers.append(_StoreSampler(store, source, self._clock))
            for publisher in publishers:
                if publisher not in _watched:
                    _watched.add(publisher)
                    self._samplers.append(_PublisherSampler(publisher))

    def take(self) -> KvtierStats | None:
        if self._samplers and self._clock() >= self._next_sample:
            self._next_sample = self._clock() + SAMPLE_INTERVAL_S
            for sampler in self._samplers:
                self.add(**sampler.sample())
        with self._lock:
            data, self._data = self._data, {}
        return KvtierStats(data=data) if data else None

    def totals(self) -> dict[str, float]:
        """Everything counted since start (for tests and `kvtier` tools)."""
        with self._lock:
            return dict(self._totals)


_watched_lock = threading.Lock()
_watched: weakref.WeakSet[TieredStore | EventPublisher] = weakref.WeakSet()


class _Deltas:
    """Turns cumulative totals into the positive deltas since the previous call."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def __call__(self, totals: dict[str, float]) -> dict[str, float]:
        out = {}
        for name, value in totals.items():
            delta = value - self._seen.get(name, 0)
            self._seen[name] = value
            if delta > 0:
                out[name] = delta
        return out


class _PublisherSampler:
    """Turns a KV-event publisher's cumulative counts into counter deltas."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher
        self._deltas = _Deltas()

    def sample(self) -> dict[str, float]:
        publisher = self._publisher
        return self._deltas(
            {
                "events_published": publisher.published,
                "events_dropped": publisher.dropped,
                "event_snapshots": publisher.snapshots,
            }
        )


class _StoreSampler:
    """Turns a store's cumulative stats into counter deltas and gauge values."""

    def __init__(self, store: TieredStore, source: str, clock: Any) -> None:
        self._store = store
        self._source = source
        self._clock = clock
        self._deltas = _Deltas()
        self._status: dict[str, float] = {}
        self._status_at: float | None = None

    def sample(self) -> dict[str, float]:
        totals, gauges = _store_figures(self._store.stats())
        gauges.update(self._l2_status())
        out = {f"{key}@{self._source}": value for key, value in gauges.items()}
        return out | self._deltas(totals)

    def _l2_status(self) -> dict[str, float]:
        """The pool's figures from the status file the lease holder writes (any replica's)."""
        path = self._store.config.l2_path
        if path is None or self._store.config.l2_capacity_bytes is None:
            return {}
        now = self._clock()
        if self._status_at is None or now - self._status_at >= STATUS_INTERVAL_S:
            self._status_at = now
            report = read_status(path)
            if report is not None:
                self._status = {
                    "l2_used_bytes": float(report["used_bytes_after"]),  # type: ignore[arg-type]
                    "l2_capacity_bytes": float(report["capacity_bytes"]),  # type: ignore[arg-type]
                    "l2_high_bytes": float(report["high_bytes"]),  # type: ignore[arg-type]
                    "l2_low_bytes": float(report["low_bytes"]),  # type: ignore[arg-type]
                    "l2_blocks": float(report["blocks_after"]),  # type: ignore[arg-type]
                    "l2_graveyard_bytes": float(report["graveyard_bytes"]),  # type: ignore[arg-type]
                    "l2_last_pass_time": float(report["finished_at"]),  # type: ignore[arg-type]
                }
        return dict(self._status)


def _store_figures(stats: StoreStats) -> tuple[dict[str, float], dict[str, float]]:
    """(cumulative counters, gauges) of one store snapshot, by wire key."""
    totals: dict[str, float] = {
        "l2_dropped_writes": stats.l2_dropped,
        "l2_write_cpu_seconds": stats.l2_write_cpu_seconds,
    }
    gauges: dict[str, float] = {"l2_queue_depth": stats.l2_queue_depth}
    if stats.l1 is not None:
        totals.update(
            l1_read_bytes=stats.l1.bytes_read,
            l1_written_bytes=stats.l1.bytes_written,
            l1_errors=stats.l1.errors,
            l1_evicted_blocks=stats.l1.evicted,
        )
        gauges.update(
            l1_used_bytes=stats.l1.used_bytes,
            l1_capacity_bytes=stats.l1.capacity_bytes or 0,
            l1_blocks=stats.l1.objects or 0,
        )
    if stats.l2 is not None:
        totals.update(
            l2_read_bytes=stats.l2.bytes_read,
            l2_written_bytes=stats.l2.bytes_written,
            l2_errors=stats.l2.errors + stats.l2_write_errors,
            l2_corrupt_removed=stats.l2.corrupt_removed,
        )
    if stats.janitor is not None:
        totals.update(
            janitor_passes=stats.janitor.passes,
            l2_evicted_blocks=stats.janitor.evicted_blocks,
            l2_evicted_bytes=stats.janitor.evicted_bytes,
            l2_orphans_removed=stats.janitor.orphans_removed,
        )
        gauges["l2_lease_held"] = 1.0 if stats.janitor.lease_held else 0.0
    return totals, gauges


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The families of `CONNECTOR_METRICS` and `L2_METRICS`, per engine (vLLM's labels first)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes: dict[str, Any] = {
            "counter": self._counter_cls,
            "gauge": self._gauge_cls,
            "histogram": self._histogram_cls,
        }
        self._families: dict[str, Any] = {}
        for d in CONNECTOR_METRICS + L2_METRICS:
            options: dict[str, Any] = {}
            if d.kind == "gauge":
                options["multiprocess_mode"] = "mostrecent"
            elif d.kind == "histogram":
                options["buckets"] = list(d.buckets)
            self._families[d.name] = classes[d.kind](
                name=d.name, documentation=d.help, labelnames=[*labelnames, *d.labels], **options
            )
        self._children: dict[tuple[int, str], Any] = {}
        self._gauge_values: dict[tuple[int, str], dict[str, float]] = {}
        """(engine, gauge) -> source -> its latest value."""
        for engine_idx in per_engine_labelvalues:  # counters and histograms start at 0
            for key, (family, labels) in COUNTERS.items():
                self._child(engine_idx, key, family, labels)
            for key, family in HISTOGRAMS.items():
                self._child(engine_idx, key, family, ())

    def _child(self, engine_idx: int, key: str, family: str, labels: tuple[str, ...]) -> Any:
        child = self._children.get((engine_idx, key))
        if child is None:
            engine = self.per_engine_labelvalues.get(engine_idx)
            if engine is None:
                return None
            child = self._families[family].labels(*engine, *labels)
            self._children[(engine_idx, key)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in COUNTERS:
                family, labels = COUNTERS[key]
                child = self._child(engine_idx, key, family, labels)
                if child is not None and value > 0:
                    child.inc(value)
            elif (gauge := _gauge(key)) is not None:
                base, _, source = key.partition("@")
                child = self._child(engine_idx, base, gauge, ())
                if child is not None:
                    latest = self._gauge_values.setdefault((engine_idx, base), {})
                    latest[source] = value
                    child.set(max(latest.values()))
            elif key in HISTOGRAMS:
                child = self._child(engine_idx, key, HISTOGRAMS[key], ())
                if child is not None:
                    for seconds in value:
                        child.observe(seconds)
