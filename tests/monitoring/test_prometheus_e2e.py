"""A real fleet watched by a real Prometheus (`LocalFleet(monitor=True)`, what `kvtier up
--monitor` runs): two vLLM replicas with the connector, a shared L2 small enough for the janitor
to evict, the router, Prometheus scraping all three every second. After a short workload that
hits every tier: every target is up, every recording rule and every Grafana panel query returns
data, the figures agree across the router, the replicas and Prometheus, and the dashboard in
headless Chromium shows them. Starts vLLM engines: run under the heavy-job lock."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.core.errors import ConfigError
from kvtier.net.ports import free_port, free_port_range
from kvtier.router.dashboard.scrape import parse_samples
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.cluster.local_fleet import LocalFleet
from kvtier.tools.cluster.spec import CacheSpec, FleetSpec, L2Spec, LocalSpec
from kvtier.tools.monitoring import Prometheus, capture_dashboard, require_binary
from tests.monitoring.test_catalogue import VLLM_USED, grafana_exprs, recorded
from tests.monitoring.test_dashboard import rendered

pytestmark = pytest.mark.engine

DOC_TOKENS = 900


def chat(url: str, model: str, system: str, question: str) -> dict[str, Any]:
    """One streamed chat request; the usage of its last event."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def totals(url: str, prefixes: tuple[bytes, ...]) -> dict[str, float]:
    """Samples of a /metrics page summed by name and the one label that matters here."""
    out: dict[str, float] = {}
    for name, labels, value in parse_samples(httpx.get(url + "/metrics").content, prefixes):
        key = name + "".join(f"{{{labels[k]}}}" for k in ("tier", "source") if k in labels)
        out[key] = out.get(key, 0.0) + value
    return out


def scalar(prom: Prometheus, expr: str) -> float:
    result = prom.query(expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def settle(prom: Prometheus, expr: str, want: float, timeout_s: float = 30.0) -> float:
    """Wait until Prometheus's value of `expr` is `want` (a scrape or two behind the source)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = scalar(prom, expr)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_a_monitored_fleet_has_every_target_up_and_every_rule_and_panel_returns_data(
    tmp_path: Path, corpus: Corpus
) -> None:
    try:
        require_binary("prometheus")
    except ConfigError as exc:
        pytest.skip(str(exc))
    spec = FleetSpec(
        replicas=2,
        # 128-token blocks of 5.6 MiB (float32, whatever the CPU: in bfloat16 they are half
        # that and nothing is evicted): L1 holds 18 per replica, L2 27 (evicts above 24)
        cache=CacheSpec(l1_gib=0.1, l2=L2Spec(size_gib=0.15)),
        local=LocalSpec(
            engine_dtype="float32",
            engine_kv_cache_blocks=16,  # L0: 2,048 tokens, two documents
            router_port=free_port(),
            replica_base_port=free_port_range(2),
            work_dir=str(tmp_path / "fleet"),
            connector={"l2_janitor_interval_s": 0.5},
        ),
    )
    docs = [corpus.document(DOC_TOKENS, seed) for seed in range(5)]  # 7 blocks each
    with LocalFleet(spec, progress=False, monitor=True) as fleet:
        prom = fleet.prometheus
        assert prom is not None
        url, model = fleet.url, fleet.model_name
        a, b = fleet.replica_urls
        # through the router: three documents computed, asked again (L0 hits), the first
        # again once the others pushed it out of its engine's cache (L1 or L2)
        for doc in (*docs[:3], *docs[:3], docs[0]):
            chat(url, model, doc, "Summarize this.")
        # straight to each replica: a document only the other one computed comes from L2
        cross = [chat(replica, model, doc, "And now?") for replica in (a, b) for doc in docs[:3]]
        assert any(u["prompt_tokens_details"]["cached_tokens"] for u in cross)
        # two more documents: 35 blocks in an L2 that evicts above 24
        for doc in docs[3:]:
            chat(url, model, doc, "Summarize this.")
        time.sleep(2)  # a janitor pass
        chat(url, model, docs[4], "One more.")  # the engines step: their gauges move
        time.sleep(3)

        # every target is up
        targets = prom.api("targets")["activeTargets"]
        assert {(t["labels"]["job"], t["health"]) for t in targets} == {
            ("kvtier-router", "up"),
            ("kvtier-replica", "up"),
        }
        assert len(targets) == 3
        # the replicas' own series kvtier queries exist on a real vLLM
        page = httpx.get(a + "/metrics").text
        for name in VLLM_USED:
            assert f"\n{name}{{" in page, name
        # every recording rule and every Grafana panel query returns data
        for record in sorted(recorded()):
            assert prom.query(record), record
        for expr in grafana_exprs():
            query = expr.replace("$__rate_interval", "1m")
            assert prom.query(query), expr

        # the tiers: every one served tokens, and the janitor evicted from the small L2
        served = {
            r["metric"]["tier"]: float(r["value"][1])
            for r in prom.query("kvtier:served_tokens:rate1m")
        }
        assert set(served) == {"l0", "l1", "l2", "computed"}
        assert served["l0"] > 0 and served["l2"] > 0 and served["computed"] > 0
        assert scalar(prom, "sum(kvtier_l2_evicted_blocks_total)") > 0
        assert scalar(prom, "sum(kvtier_l2_janitor_lease_held)") >= 1
        assert 0 < scalar(prom, "kvtier:routing_accuracy:ratio_rate1m") <= 1

        # the same figures at the router, the replicas and Prometheus
        router = totals(url, (b"kvtier_router_prompt_tokens_total", b"kvtier_router_cached"))
        replicas = [totals(r, (b"vllm:prompt_tokens_total",)) for r in (a, b)]
        via_router = router["kvtier_router_prompt_tokens_total"]
        direct = sum(u["prompt_tokens"] for u in cross)
        assert sum(r["vllm:prompt_tokens_total"] for r in replicas) == via_router + direct
        assert settle(prom, "sum(kvtier_router_prompt_tokens_total)", via_router) == via_router

        # the dashboard in a browser shows the router's figures and the replicas' tiers
        try:
            require_binary("chromium")
        except ConfigError:
            return
        dom = rendered(capture_dashboard(url + "/dashboard", wait_ms=2500))
        assert float(dom.kpis["prompt_tokens"]) == via_router
        assert float(dom.kpis["cached_tokens"]) == router["kvtier_router_cached_tokens_total"]
        assert float(dom.kpis["requests"]) == 10
        l2_used = scalar(prom, "max(kvtier_l2_used_bytes)")
        assert float(dom.attrs_of["l2-summary"]["data-value"]) == l2_used
