"""The connector's and the L2 janitor's Prometheus families, and the stats keys that feed them.

Declared as data (no vLLM import, so `docs/metrics.md` renders without loading vLLM);
`kvtier.vllm.stats` builds the collectors and carries the values through vLLM's hooks.
"""

from __future__ import annotations

from kvtier.core.metric_defs import LATENCY_BUCKETS, MetricDef

__all__ = ["CONNECTOR_METRICS", "COUNTERS", "GAUGES", "HISTOGRAMS", "L2_METRICS"]

_TIER = ("tier",)
_L1_L2 = "tier: l1, l2"

CONNECTOR_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "kvtier_connector_lookups",
        "counter",
        "Longest-prefix lookups the scheduler ran against L1 and L2.",
    ),
    MetricDef(
        "kvtier_connector_lookup_blocks",
        "counter",
        "Blocks asked about by lookups.",
    ),
    MetricDef(
        "kvtier_connector_lookup_hit_blocks",
        "counter",
        "Blocks of the contiguous cached prefixes lookups found.",
    ),
    MetricDef(
        "kvtier_connector_hit_tokens",
        "counter",
        "Prompt tokens the scheduler planned to load from a kvtier tier instead of computing.",
        _TIER,
        _L1_L2,
    ),
    MetricDef(
        "kvtier_connector_loaded_blocks",
        "counter",
        "kvtier blocks loaded into vLLM's KV cache.",
        _TIER,
        _L1_L2,
    ),
    MetricDef(
        "kvtier_connector_loaded_bytes",
        "counter",
        "Payload bytes loaded into vLLM's KV cache.",
    ),
    MetricDef(
        "kvtier_connector_load_seconds",
        "histogram",
        "Wall time of one request's load (store read and copy into the KV cache).",
        buckets=LATENCY_BUCKETS,
    ),
    MetricDef(
        "kvtier_connector_load_failed_blocks",
        "counter",
        "Engine blocks that failed to load (vLLM recomputes them).",
    ),
    MetricDef(
        "kvtier_connector_load_deadline_missed",
        "counter",
        "Loads that missed the load deadline; their unwritten blocks are recomputed.",
    ),
    MetricDef(
        "kvtier_connector_saved_blocks",
        "counter",
        "Computed blocks the store admitted (copied to L1, queued for L2).",
    ),
    MetricDef(
        "kvtier_connector_saved_bytes",
        "counter",
        "Payload bytes of the admitted blocks.",
    ),
    MetricDef(
        "kvtier_connector_save_seconds",
        "histogram",
        "Wall time of one request's save step (copy out of the KV cache and store put).",
        buckets=LATENCY_BUCKETS,
    ),
    MetricDef(
        "kvtier_connector_save_skipped_blocks",
        "counter",
        "Computed blocks not saved because the store already held them.",
    ),
    MetricDef(
        "kvtier_connector_save_rejected_blocks",
        "counter",
        "Computed blocks the admission policy refused.",
    ),
    MetricDef(
        "kvtier_connector_save_failed_blocks",
        "counter",
        "Blocks whose copy out of the KV cache failed.",
    ),
    MetricDef(
        "kvtier_connector_tier_read_bytes",
        "counter",
        "Payload bytes read from a tier (L1 hits, L2 reads).",
        _TIER,
        _L1_L2,
    ),
    MetricDef(
        "kvtier_connector_tier_written_bytes",
        "counter",
        "Payload bytes written into a tier (L1 copies and promotions, L2 write-through).",
        _TIER,
        _L1_L2,
    ),
    MetricDef(
        "kvtier_connector_tier_errors",
        "counter",
        "I/O faults of a tier, turned into misses or failed writes.",
        _TIER,
        _L1_L2,
    ),
    MetricDef(
        "kvtier_connector_l1_evicted_blocks",
        "counter",
        "Blocks L1 evicted to make room (least recently used first).",
    ),
    MetricDef(
        "kvtier_connector_l1_used_bytes",
        "gauge",
        "Bytes L1 holds (per TP rank).",
    ),
    MetricDef(
        "kvtier_connector_l1_capacity_bytes",
        "gauge",
        "L1's byte budget (per TP rank).",
    ),
    MetricDef(
        "kvtier_connector_l1_blocks",
        "gauge",
        "Blocks L1 holds (per TP rank).",
    ),
    MetricDef(
        "kvtier_connector_l2_dropped_writes",
        "counter",
        "L2 write-throughs dropped because the write queue was full (a save drop).",
    ),
    MetricDef(
        "kvtier_connector_l2_queue_depth",
        "gauge",
        "L2 writes queued or in progress.",
    ),
    MetricDef(
        "kvtier_connector_l2_unavailable",
        "counter",
        "Worker starts that found the configured L2 unusable (the store then runs L1-only).",
    ),
    MetricDef(
        "kvtier_connector_hit_phase_seconds",
        "counter",
        "Seconds cache hits spent per phase: lookup (the scheduler's existence checks), "
        "lookup_wait (requests waiting for lookup answers), queue (a planned load waiting for "
        "its loader), open, read, checksum (L2 reads), copy (into vLLM's KV cache, before "
        "the forward pass), layer_wait (the forward pass waiting for the layered copy).",
        ("phase",),
        "phase: lookup, lookup_wait, queue, open, read, checksum, copy, layer_wait",
    ),
    MetricDef(
        "kvtier_connector_layered_copy_seconds",
        "counter",
        "Seconds the copier spent reading and copying hits into vLLM's KV cache layer by layer, "
        "beside "
        "the forward passes that read them (load_layerwise).",
    ),
    MetricDef(
        "kvtier_connector_lookup_deferred_steps",
        "counter",
        "Times the scheduler answered vLLM 'still looking' (each costs a request one step).",
    ),
    MetricDef(
        "kvtier_connector_lookup_deadline_missed",
        "counter",
        "Lookups answered 'nothing cached' because L2 did not answer within load_deadline_s "
        "(the prompt was computed).",
    ),
    MetricDef(
        "kvtier_connector_cache_resets",
        "counter",
        "Cache resets vLLM asked for (reset_prefix_cache with reset_external, "
        "pause_generation(clear_cache=True)); blocks cached before one are never loaded again.",
    ),
    MetricDef(
        "kvtier_connector_save_cpu_seconds",
        "counter",
        "CPU time the saver spent copying blocks out of vLLM's KV cache into the store.",
    ),
    MetricDef(
        "kvtier_connector_l2_write_cpu_seconds",
        "counter",
        "CPU time the L2 writer threads spent writing blocks (checksum, copy out).",
    ),
    MetricDef(
        "kvtier_connector_save_dropped_blocks",
        "counter",
        "Computed blocks not saved: the saver's backlog was full, or the request was "
        "preempted before its save started.",
    ),
    MetricDef(
        "kvtier_connector_events_published",
        "counter",
        "KV events this replica's publisher numbered for the routers (sent or dropped; "
        "snapshot events included).",
    ),
    MetricDef(
        "kvtier_connector_events_dropped",
        "counter",
        "KV events the publisher dropped (its queue full or its socket refusing them): the "
        "routers' indexes miss them.",
    ),
    MetricDef(
        "kvtier_connector_event_snapshots",
        "counter",
        "Snapshots of the held L1/L2 blocks the publisher re-sent because a router subscribed.",
    ),
)

L2_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "kvtier_l2_used_bytes",
        "gauge",
        "Bytes in the shared L2 directory (live blocks and blocks being written) after the "
        "janitor's latest pass; every replica reports the same pool: take the max.",
    ),
    MetricDef("kvtier_l2_capacity_bytes", "gauge", "The shared L2's configured capacity."),
    MetricDef(
        "kvtier_l2_high_watermark_bytes",
        "gauge",
        "Usage above which a janitor pass evicts.",
    ),
    MetricDef(
        "kvtier_l2_low_watermark_bytes",
        "gauge",
        "Usage an evicting pass brings L2 down to.",
    ),
    MetricDef("kvtier_l2_blocks", "gauge", "Blocks in the shared L2 after the latest pass."),
    MetricDef(
        "kvtier_l2_graveyard_bytes",
        "gauge",
        "Evicted bytes still kept for readers that opened them (purged after a grace time).",
    ),
    MetricDef(
        "kvtier_l2_janitor_last_pass_timestamp_seconds",
        "gauge",
        "Unix time the latest janitor pass (by any replica) finished.",
    ),
    MetricDef(
        "kvtier_l2_janitor_lease_held",
        "gauge",
        "1 on the replica whose janitor holds the cluster-wide lease, else 0.",
    ),
    MetricDef(
        "kvtier_l2_janitor_passes",
        "counter",
        "Janitor passes this replica ran as the lease holder.",
    ),
    MetricDef(
        "kvtier_l2_evicted_blocks",
        "counter",
        "Blocks this replica's janitor evicted from the shared L2.",
    ),
    MetricDef(
        "kvtier_l2_evicted_bytes",
        "counter",
        "Bytes this replica's janitor evicted from the shared L2.",
    ),
    MetricDef(
        "kvtier_l2_orphans_removed",
        "counter",
        "Temp files of crashed writers this replica's janitor removed.",
    ),
    MetricDef(
        "kvtier_l2_corrupt_removed",
        "counter",
        "L2 objects this replica found invalid on read (checksum, header) and deleted.",
    ),
)

COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookups": ("kvtier_connector_lookups", ()),
    "lookup_blocks": ("kvtier_connector_lookup_blocks", ()),
    "lookup_hit_blocks": ("kvtier_connector_lookup_hit_blocks", ()),
    "hit_tokens_l1": ("kvtier_connector_hit_tokens", ("l1",)),
    "hit_tokens_l2": ("kvtier_connector_hit_tokens", ("l2",)),
    "load_blocks_l1": ("kvtier_connector_loaded_blocks", ("l1",)),
    "load_blocks_l2": ("kvtier_connector_loaded_blocks", ("l2",)),
    "load_bytes": ("kvtier_connector_loaded_bytes", ()),
    "load_failed_blocks": ("kvtier_connector_load_failed_blocks", ()),
    "load_deadline_missed": ("kvtier_connector_load_deadline_missed", ()),
    "save_blocks": ("kvtier_connector_saved_blocks", ()),
    "save_bytes": ("kvtier_connector_saved_bytes", ()),
    "save_skipped_blocks": ("kvtier_connector_save_skipped_blocks", ()),
    "save_rejected_blocks": ("kvtier_connector_save_rejected_blocks", ()),
    "save_failed_blocks": ("kvtier_connector_save_failed_blocks", ()),
    "l1_read_bytes": ("kvtier_connector_tier_read_bytes", ("l1",)),
    "l2_read_bytes": ("kvtier_connector_tier_read_bytes", ("l2",)),
    "l1_written_bytes": ("kvtier_connector_tier_written_bytes", ("l1",)),
    "l2_written_bytes": ("kvtier_connector_tier_written_bytes", ("l2",)),
    "l1_errors": ("kvtier_connector_tier_errors", ("l1",)),
    "l2_errors": ("kvtier_connector_tier_errors", ("l2",)),
    "l1_evicted_blocks": ("kvtier_connector_l1_evicted_blocks", ()),
    "l2_dropped_writes": ("kvtier_connector_l2_dropped_writes", ()),
    "l2_unavailable": ("kvtier_connector_l2_unavailable", ()),
    "janitor_passes": ("kvtier_l2_janitor_passes", ()),
    "l2_evicted_blocks": ("kvtier_l2_evicted_blocks", ()),
    "l2_evicted_bytes": ("kvtier_l2_evicted_bytes", ()),
    "l2_orphans_removed": ("kvtier_l2_orphans_removed", ()),
    "l2_corrupt_removed": ("kvtier_l2_corrupt_removed", ()),
    "phase_lookup_seconds": ("kvtier_connector_hit_phase_seconds", ("lookup",)),
    "phase_lookup_wait_seconds": ("kvtier_connector_hit_phase_seconds", ("lookup_wait",)),
    "phase_queue_seconds": ("kvtier_connector_hit_phase_seconds", ("queue",)),
    "phase_open_seconds": ("kvtier_connector_hit_phase_seconds", ("open",)),
    "phase_read_seconds": ("kvtier_connector_hit_phase_seconds", ("read",)),
    "phase_checksum_seconds": ("kvtier_connector_hit_phase_seconds", ("checksum",)),
    "phase_copy_seconds": ("kvtier_connector_hit_phase_seconds", ("copy",)),
    "phase_layer_wait_seconds": ("kvtier_connector_hit_phase_seconds", ("layer_wait",)),
    "layered_copy_seconds": ("kvtier_connector_layered_copy_seconds", ()),
    "lookup_deferred": ("kvtier_connector_lookup_deferred_steps", ()),
    "lookup_deadline_missed": ("kvtier_connector_lookup_deadline_missed", ()),
    "cache_resets": ("kvtier_connector_cache_resets", ()),
    "save_cpu_seconds": ("kvtier_connector_save_cpu_seconds", ()),
    "l2_write_cpu_seconds": ("kvtier_connector_l2_write_cpu_seconds", ()),
    "save_dropped_blocks": ("kvtier_connector_save_dropped_blocks", ()),
    "events_published": ("kvtier_connector_events_published", ()),
    "events_dropped": ("kvtier_connector_events_dropped", ()),
    "event_snapshots": ("kvtier_connector_event_snapshots", ()),
}
"""Wire key -> (counter, label values)."""
HISTOGRAMS: dict[str, str] = {
    "load_seconds": "kvtier_connector_load_seconds",
    "save_seconds": "kvtier_connector_save_seconds",
}
"""Wire key (a list of observations) -> histogram."""
GAUGES: dict[str, str] = {
    "l1_used_bytes": "kvtier_connector_l1_used_bytes",
    "l1_capacity_bytes": "kvtier_connector_l1_capacity_bytes",
    "l1_blocks": "kvtier_connector_l1_blocks",
    "l2_queue_depth": "kvtier_connector_l2_queue_depth",
    "l2_used_bytes": "kvtier_l2_used_bytes",
    "l2_capacity_bytes": "kvtier_l2_capacity_bytes",
    "l2_high_bytes": "kvtier_l2_high_watermark_bytes",
    "l2_low_bytes": "kvtier_l2_low_watermark_bytes",
    "l2_blocks": "kvtier_l2_blocks",
    "l2_graveyard_bytes": "kvtier_l2_graveyard_bytes",
    "l2_last_pass_time": "kvtier_l2_janitor_last_pass_timestamp_seconds",
    "l2_lease_held": "kvtier_l2_janitor_lease_held",
}
"""Wire key -> gauge."""
