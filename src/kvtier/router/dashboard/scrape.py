"""A replica's /metrics page read down to the figures the dashboard shows.

`parse_samples` reads Prometheus text exposition, keeping only lines whose metric name starts
with one of the given prefixes (a vLLM page is ~100 KB, almost all of it histograms the
dashboard does not need). `replica_figures` sums the wanted series over vLLM's engines (one
per data-parallel rank), except the L2 pool's gauges, which describe the one shared pool
whichever engine reports them (their max), and the engine cache's occupancy, a fraction of
each engine's own cache (their mean).

Where each figure comes from (vLLM 0.32's own metrics, the connector's `kvtier_connector_*`,
the L2 janitor's `kvtier_l2_*`; see docs/metrics.md):

    prompt_tokens         vllm:prompt_tokens_total
    l0_tokens             vllm:prompt_tokens_cached_by_source_total{source="device"}
    l1_tokens, l2_tokens  kvtier_connector_hit_tokens_total{tier}
    running, waiting      vllm:num_requests_running, vllm:num_requests_waiting
    l0_usage              vllm:kv_cache_usage_perc (fraction of the engine's KV cache in use)
    l1_*, l2_*            the connector's L1 gauges and the L2 pool's figures
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

__all__ = ["FIGURES", "parse_samples", "replica_figures"]

Sample = tuple[str, dict[str, str], float]

FIGURES: Mapping[str, tuple[str, Mapping[str, str]]] = {
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "l0_tokens": ("vllm:prompt_tokens_cached_by_source_total", {"source": "device"}),
    "l1_tokens": ("kvtier_connector_hit_tokens_total", {"tier": "l1"}),
    "l2_tokens": ("kvtier_connector_hit_tokens_total", {"tier": "l2"}),
    "running": ("vllm:num_requests_running", {}),
    "waiting": ("vllm:num_requests_waiting", {}),
    "l0_usage": ("vllm:kv_cache_usage_perc", {}),
    "l1_used_bytes": ("kvtier_connector_l1_used_bytes", {}),
    "l1_capacity_bytes": ("kvtier_connector_l1_capacity_bytes", {}),
    "l2_dropped_writes": ("kvtier_connector_l2_dropped_writes_total", {}),
    "load_failed_blocks": ("kvtier_connector_load_failed_blocks_total", {}),
    "l2_used_bytes": ("kvtier_l2_used_bytes", {}),
    "l2_capacity_bytes": ("kvtier_l2_capacity_bytes", {}),
    "l2_high_bytes": ("kvtier_l2_high_watermark_bytes", {}),
    "l2_low_bytes": ("kvtier_l2_low_watermark_bytes", {}),
    "l2_blocks": ("kvtier_l2_blocks", {}),
    "l2_lease_held": ("kvtier_l2_janitor_lease_held", {}),
    "l2_evicted_blocks": ("kvtier_l2_evicted_blocks_total", {}),
    "l2_evicted_bytes": ("kvtier_l2_evicted_bytes_total", {}),
    "l2_corrupt_removed": ("kvtier_l2_corrupt_removed_total", {}),
}
"""Figure -> (sample name, labels it must carry); the figure sums the matching samples (but
see `_MAX`, `_MEAN`)."""
PREFIXES = tuple(sorted({name.encode() for name, _ in FIGURES.values()}))
_MAX = frozenset(
    (
        "l2_used_bytes",
        "l2_capacity_bytes",
        "l2_high_bytes",
        "l2_low_bytes",
        "l2_blocks",
        "l2_lease_held",
    )
)
"""Figures of the shared L2 pool: the same pool on every engine, never added up."""
_MEAN = frozenset(("l0_usage",))
"""Fractions of each engine's own capacity: their mean."""

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: bytes, prefixes: tuple[bytes, ...]) -> list[Sample]:
    """(name, labels, value) of every sample whose name starts with one of `prefixes` and
    whose value is a finite number."""
    out: list[Sample] = []
    for line in text.split(b"\n"):
        if not line.startswith(prefixes):
            continue
        decoded = line.decode("utf-8", "replace")
        brace = decoded.find("{")
        if brace >= 0:
            end = decoded.rfind("}")
            name, labels = decoded[:brace], dict(_LABEL.findall(decoded[brace + 1 : end]))
            rest = decoded[end + 1 :].split()
        else:
            name, *rest = decoded.split()
            labels = {}
        try:
            value = float(rest[0])
        except (IndexError, ValueError):
            continue  # not a sample line we understand: skip it
        if math.isfinite(value):  # (NaN or Inf would make the dashboard's feed invalid JSON)
            out.append((name, labels, value))
    return out


def replica_figures(text: bytes) -> dict[str, float]:
    """The figures of `FIGURES` a replica's page has (absent ones are left out)."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in parse_samples(text, PREFIXES):
        by_name.setdefault(name, []).append((labels, value))
    figures: dict[str, float] = {}
    for figure, (name, wanted) in FIGURES.items():
        matches = [
            value
            for labels, value in by_name.get(name, ())
            if all(labels.get(k) == v for k, v in wanted.items())
        ]
        if not matches:
            continue
        if figure in _MAX:
            figures[figure] = max(matches)
        elif figure in _MEAN:
            figures[figure] = sum(matches) / len(matches)
        else:
            figures[figure] = sum(matches)
    return figures
