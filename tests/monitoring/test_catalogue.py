"""docs/metrics.md is what the code declares, and everything that queries kvtier's metrics (the
recording and alert rules, the Grafana panels, the router dashboard) names only declared ones.
Regenerate the catalogue with `python -m kvtier.tools.monitoring catalogue > docs/metrics.md`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvtier.core.metric_defs import MetricDef
from kvtier.router.dashboard.scrape import FIGURES
from kvtier.router.metrics import ROUTER_METRICS
from kvtier.tools.monitoring import RULES_DIR, render_catalogue
from kvtier.vllm.connector_metrics import (
    CONNECTOR_METRICS,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    L2_METRICS,
)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "metrics.md"
GRAFANA = REPO / "deploy" / "grafana" / "kvtier-fleet.json"
ALL = ROUTER_METRICS + CONNECTOR_METRICS + L2_METRICS
VLLM_USED = {
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:prompt_tokens_cached_by_source_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
}
"""vLLM 0.32's own series kvtier queries (the engine e2e test finds each on a real replica)."""
NAME = re.compile(r"\b(kvtier_[a-z0-9_]+|kvtier:[a-z0-9_:]+|vllm:[a-z0-9_:]+|up)\b")


def rules(name: str) -> list[dict[str, object]]:
    doc = yaml.safe_load((RULES_DIR / name).read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def recorded() -> set[str]:
    return {str(r["record"]) for r in rules("kvtier.rules.yml")}


def grafana_exprs() -> list[str]:
    doc = json.loads(GRAFANA.read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def test_the_catalogue_is_in_sync_with_the_code() -> None:
    assert DOC.read_text() == render_catalogue()


def test_names_are_unique_and_follow_the_conventions() -> None:
    names = [d.name for d in ALL]
    assert len(names) == len(set(names))
    for d in ALL:
        assert d.help.endswith("."), d.name
        if d.kind == "histogram" or "seconds" in d.name:
            assert d.name.endswith("_seconds"), d.name
        if "bytes" in d.name:
            assert d.name.endswith("_bytes"), d.name
        assert d.name.startswith(("kvtier_router_", "kvtier_connector_", "kvtier_l2_"))
    with pytest.raises(ValueError, match="_total"):
        MetricDef("kvtier_x_total", "counter", "X.")
    with pytest.raises(ValueError, match="buckets"):
        MetricDef("kvtier_x_seconds", "histogram", "X.")


def test_every_stats_key_feeds_a_declared_family() -> None:
    declared = {d.name: d for d in CONNECTOR_METRICS + L2_METRICS}
    for family, labels in COUNTERS.values():
        assert declared[family].kind == "counter" and len(labels) == len(declared[family].labels)
    assert all(declared[f].kind == "gauge" for f in GAUGES.values())
    assert all(declared[f].kind == "histogram" for f in HISTOGRAMS.values())
    fed = {f for f, _ in COUNTERS.values()} | set(GAUGES.values()) | set(HISTOGRAMS.values())
    assert fed == set(declared)


@pytest.mark.parametrize("source", ["rules", "alerts", "grafana", "dashboard"])
def test_queries_name_only_declared_metrics_and_recorded_series(source: str) -> None:
    exprs = {
        "rules": lambda: [str(r["expr"]) for r in rules("kvtier.rules.yml")],
        "alerts": lambda: [str(r["expr"]) for r in rules("kvtier.alerts.yml")],
        "grafana": grafana_exprs,
        "dashboard": lambda: [name for name, _ in FIGURES.values()],
    }[source]()
    known = {n for d in ALL for n in d.sample_names} | VLLM_USED | recorded() | {"up"}
    used = {m for e in exprs for m in NAME.findall(re.sub(r'"[^"]*"', '""', e))}
    assert used, source
    assert used <= known, used - known
