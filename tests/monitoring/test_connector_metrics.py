"""The connector's metrics path without an engine: counters added by the connector's threads and
read from a real store (L1 + a capacity-bound L2 directory with its janitor) become stats
deltas, aggregate like vLLM aggregates them, and end up as Prometheus families on a registry
(the same `KvtierPromMetrics` vLLM builds, given prometheus_client's real classes)."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.core.codec import HEADER_BYTES
from kvtier.core.settings import StoreSettings
from kvtier.core.store import TieredStore
from kvtier.net.kv_events import EventPublisher
from kvtier.router.dashboard.scrape import parse_samples
from kvtier.vllm.stats import ConnectorCounters, KvtierPromMetrics, KvtierStats
from tests.helpers.l2 import IDENTITY, make_block, poll

BLOCK = 64 * 1024
FILE = BLOCK + HEADER_BYTES


def prom() -> tuple[KvtierPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types: dict[type, Any] = {
        cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)
    }
    metrics = KvtierPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["model_name", "engine"],
        {0: ["smol", "0"]},
    )
    return metrics, registry


def samples(registry: CollectorRegistry) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in parse_samples(generate_latest(registry), (b"kvtier_",)):
        extra = ",".join(
            f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("engine", "model_name")
        )
        out[f"{name}{{{extra}}}" if extra else name] = value
    return out


def test_counter_deltas_and_latencies_aggregate_and_export() -> None:
    worker, scheduler = ConnectorCounters(), ConnectorCounters()
    worker.add(load_blocks_l1=2, load_bytes=4096, load_seconds=0.003, load_max_seconds=0.003)
    worker.add(load_blocks_l2=1, load_bytes=2048, load_seconds=0.02, load_max_seconds=0.02)
    scheduler.add(hit_tokens_l1=256, hit_tokens_l2=128, lookups=1, lookup_blocks=4)
    step = worker.take()
    assert step is not None and worker.take() is None  # deltas: handed out once
    own = scheduler.take()
    assert own is not None
    combined = step.aggregate(own)  # what vLLM's scheduler does with the workers' stats
    assert combined.reduce()["load_ms_per_block"] == round(1000 * 0.023 / 3, 3)
    metrics, registry = prom()
    metrics.observe(combined.data)
    metrics.observe(KvtierStats(data={"load_blocks_l1": 1}).data)
    got = samples(registry)
    assert got["kvtier_connector_loaded_blocks_total{tier=l1}"] == 3
    assert got["kvtier_connector_loaded_blocks_total{tier=l2}"] == 1
    assert got["kvtier_connector_loaded_bytes_total"] == 6144
    assert got["kvtier_connector_hit_tokens_total{tier=l1}"] == 256
    assert got["kvtier_connector_lookups_total"] == 1
    assert got["kvtier_connector_load_seconds_count"] == 2
    assert got["kvtier_connector_load_seconds_bucket{le=0.005}"] == 1
    assert got["kvtier_connector_load_seconds_sum"] == 0.023
    # every counter and histogram is exported from the start, at zero
    assert got["kvtier_connector_load_failed_blocks_total"] == 0
    assert got["kvtier_l2_corrupt_removed_total"] == 0
    assert got["kvtier_connector_save_seconds_count"] == 0


def test_a_gauge_is_the_largest_latest_value_over_its_source_processes() -> None:
    """The scheduler's process has its own store (no L1 blocks): its zero must not hide the
    worker's L1, and an update from the worker replaces the worker's earlier value."""
    metrics, registry = prom()
    metrics.observe({"l1_used_bytes@worker": 100.0, "l2_lease_held@worker": 0.0})
    metrics.observe({"l1_used_bytes@scheduler": 0.0, "l2_lease_held@scheduler": 1.0})
    assert samples(registry)["kvtier_connector_l1_used_bytes"] == 100
    assert samples(registry)["kvtier_l2_janitor_lease_held"] == 1
    metrics.observe({"l1_used_bytes@worker": 40.0})
    assert samples(registry)["kvtier_connector_l1_used_bytes"] == 40


def test_watched_stores_report_tiers_l1_occupancy_and_the_janitor(tmp_path: Path) -> None:
    config = StoreSettings(
        l1_bytes=6 * BLOCK,
        l2_path=str(tmp_path),
        l2_exists_ttl_s=0,
        io_threads=1,
        l2_capacity_bytes=10 * FILE,
        l2_high_watermark=0.85,
        l2_low_watermark=0.45,
        l2_janitor_interval_s=0.1,
    )
    clock = [0.0]
    counters = ConnectorCounters(clock=lambda: clock[0])
    with TieredStore(config, IDENTITY) as store, TieredStore(config, IDENTITY) as again:
        counters.watch([store, store], source="worker")
        ConnectorCounters().watch([store], source="scheduler")  # already reported: ignored
        counters.watch([again], source="scheduler")  # another process's store, say
        for i in range(12):  # twelve chains of one block: L1 keeps the last six
            h, meta, payload = make_block(100 + i, 0, BLOCK)
            assert store.save(h, meta, payload)
        assert store.flush(timeout_s=30)
        evicted = poll(
            lambda: (store.stats().janitor or again.stats().janitor) and _evicted(store, again), 30
        )
        assert evicted
        assert poll(lambda: _reported(store, again), 10)  # by whichever holds the lease
        time.sleep(0.3)  # the status file of a later pass
        stats = counters.take()
        assert stats is not None
        first = dict(stats.data)
        clock[0] += 0.5
        assert counters.take() is None  # sampled at most once a second
        clock[0] += 1.0
        h, meta, payload = make_block(8, 0, BLOCK)
        assert store.save(h, meta, payload) and store.flush(timeout_s=30)
        later = counters.take()
        assert later is not None
    l1 = store.stats().l1
    assert l1 is not None
    assert first["l1_used_bytes@worker"] == 6 * BLOCK  # L1 full; it evicted the rest
    assert first["l1_capacity_bytes@worker"] == 6 * BLOCK
    # the two samples' deltas add up to the store's totals
    for key, total in (("l1_evicted_blocks", l1.evicted), ("l1_written_bytes", l1.bytes_written)):
        assert first[key] + later.data.get(key, 0) == total > 0
    assert first["l2_written_bytes"] == 12 * BLOCK
    assert first["l1_used_bytes@scheduler"] == 0  # the other store saved nothing
    assert first["l2_capacity_bytes@worker"] == 10 * FILE
    assert first["l2_high_bytes@worker"] == int(10 * FILE * 0.85)
    assert first["l2_used_bytes@worker"] <= first["l2_high_bytes@worker"]
    held = first["l2_lease_held@worker"] + first["l2_lease_held@scheduler"]
    assert held == 1  # exactly one of the two janitors holds the lease
    assert first["l2_evicted_blocks"] >= 12 - 4  # down to the low watermark (4.5 files)
    assert first["janitor_passes"] >= 1
    assert later.data["l2_written_bytes"] == BLOCK  # a delta, not the total again


def _evicted(*stores: TieredStore) -> bool:
    return any(s.stats().janitor and s.stats().janitor.evicted_blocks for s in stores)


def _reported(*stores: TieredStore) -> bool:
    """Whether a janitor pass wrote its report (only the lease holder's janitor runs one)."""
    return any(s.stats().janitor and s.stats().janitor.last_report for s in stores)


def test_a_watched_publisher_reports_events_drops_and_snapshots() -> None:
    from kvtier.core.events import EventKind
    from kvtier.core.tiers.base import Tier
    from kvtier.net.kv_events import EventSubscriber
    from tests.helpers.router import free_endpoint
    from tests.helpers.tiers import hash_of

    endpoint = free_endpoint()
    clock = [0.0]
    counters = ConnectorCounters(clock=lambda: clock[0])
    with EventPublisher(endpoint, "r1", max_queue=1) as pub:
        counters.watch([], source="worker", publishers=[pub, pub])
        ConnectorCounters().watch([], source="scheduler", publishers=[pub])  # reported once
        pub.publish(EventKind.STORED, Tier.L1, [hash_of("a")])
        time.sleep(0.3)  # sent to nobody: the subscriber hears it only in its snapshot
        with EventSubscriber([endpoint]) as sub:
            assert poll(lambda: sub.recv(0.1) is not None, 10)  # the snapshot
        for i in range(200):  # faster than the sender: the one-event queue drops some
            pub.publish(EventKind.STORED, Tier.L1, [hash_of(str(i))])
        first = counters.take()
    assert first is not None
    assert first.data["event_snapshots"] == 1 == pub.snapshots
    assert first.data["events_dropped"] == pub.dropped > 0
    assert first.data["events_published"] == pub.published == 1 + 2 + 200  # snapshot: 2 events
    metrics, registry = prom()
    metrics.observe(first.data)
    assert samples(registry)["kvtier_connector_event_snapshots_total"] == 1
