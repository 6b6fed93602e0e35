"""The router's dashboard: the JSON feed against the router's counters and the replicas' pages,
the vendored assets, and the page as headless Chromium renders it during a workload."""

from __future__ import annotations

import asyncio
import re
from html.parser import HTMLParser
from typing import Any

import pytest

from kvtier.core.errors import ConfigError
from kvtier.router.dashboard.scrape import parse_samples
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.monitoring import capture_dashboard, require_binary
from tests.helpers.aio import run
from tests.helpers.router import MAX_MODEL_LEN, MODEL, completion, running_router
from tests.monitoring.fake_vllm import MeteredReplica, metered_fleet

MiB = 1024 * 1024


def replica(**options: Any) -> MeteredReplica:
    return MeteredReplica(model=MODEL, max_model_len=MAX_MODEL_LEN, block_tokens=16, **options)


def fleet() -> tuple[MeteredReplica, MeteredReplica]:
    l2 = {"l2_capacity_bytes": 100 * MiB, "l2_high_bytes": 90 * MiB, "l2_low_bytes": 75 * MiB}
    a = replica(
        prompt_tokens=400,
        cached_tokens=300,
        figures={
            "prompt_tokens": 1000,
            "l0_tokens": 500,
            "l1_tokens": 200,
            "l2_tokens": 100,
            "running": 1,
            "waiting": 0,
            "l0_usage": 0.25,
            "l1_used_bytes": 1 * MiB,
            "l1_capacity_bytes": 4 * MiB,
            "l2_used_bytes": 60 * MiB,
            "l2_blocks": 12,
            "l2_lease_held": 1,
            "l2_evicted_blocks": 5,
            **l2,
        },
    )
    b = replica(
        prompt_tokens=200,
        cached_tokens=0,
        figures={
            "prompt_tokens": 600,
            "l0_tokens": 0,
            "l1_tokens": 0,
            "l2_tokens": 300,
            "l1_used_bytes": 2 * MiB,
            "l1_capacity_bytes": 4 * MiB,
            "l2_used_bytes": 58 * MiB,  # an older status read: the pool's figure is the max
            "l2_blocks": 11,
            "l2_lease_held": 0,
            "l2_evicted_blocks": 0,
            **l2,
        },
    )
    return a, b


def test_the_feed_joins_the_router_counters_and_the_replicas_pages(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        a, b = fleet()
        async with metered_fleet(a, b), running_router(tokenizer, [a, b]) as rr:
            for i in range(4):
                body = completion(f"prompt number {i}", stream=i % 2 == 0)
                assert (await rr.client.post(rr.url + "/v1/completions", json=body)).is_success
            doc = (await rr.client.get(rr.url + "/dashboard/data")).json()
            # the replicas serve 100 more tokens each from L0 and compute 50 more
            a.figures.update(prompt_tokens=1150, l0_tokens=600)
            await asyncio.sleep(1.1)
            later = (await rr.client.get(rr.url + "/dashboard/data/latest")).json()

        t = doc["totals"]
        routed = {r["name"]: r["routed"] for r in doc["replicas"]}
        assert t["requests"] == 4 and t["errors"] == 0 and sum(routed.values()) == 4
        assert t["prompt_tokens"] == 400 * routed[a.url] + 200 * routed[b.url]
        assert t["cached_tokens"] == 300 * routed[a.url]
        assert t["cached_share"] == round(t["cached_tokens"] / t["prompt_tokens"], 4)
        assert t["ttft_count"] == 2  # the streamed ones
        assert t["tokens"] == {"l0": 500, "l1": 200, "l2": 400, "computed": 500}
        assert doc["decisions"] == {"cold": 4}
        ra, rb = doc["replicas"]
        assert (ra["name"], ra["healthy"], ra["state"], ra["scraped"]) == (a.url, True, "up", True)
        assert ra["hit_ratio"] == {"l0": 0.5, "l1": 0.2, "l2": 0.1, "computed": 0.2}
        assert (ra["l0_usage"], ra["l1_used_bytes"], ra["lease_held"]) == (0.25, MiB, True)
        assert rb["hit_ratio"]["l2"] == 0.5 and rb["lease_held"] is False
        assert doc["l2"] == {
            "used_bytes": 60 * MiB,
            "capacity_bytes": 100 * MiB,
            "high_bytes": 90 * MiB,
            "low_bytes": 75 * MiB,
            "blocks": 12,
            "evicted_blocks": 5,
            "evicted_bytes": 0,
            "corrupt_removed": 0,
            "dropped_writes": 0,
            "lease_holder": a.url,
        }
        point = later["series"][-1]
        previous = next(p for p in later["series"] if p["t"] < point["t"])
        seconds = point["t"] - previous["t"]
        rates = point["tokens_per_s"]
        assert rates["l0"] == pytest.approx(100 / seconds, rel=0.05)
        assert rates["computed"] == pytest.approx(50 / seconds, rel=0.05)
        assert rates["l1"] == rates["l2"] == 0
        assert point["l2_used_bytes"] == 60 * MiB

    run(scenario())


def test_the_page_and_its_assets_come_from_the_router_alone(tokenizer: Tokenizer) -> None:
    async def scenario() -> dict[str, tuple[int, str, str]]:
        a, _ = fleet()
        async with metered_fleet(a), running_router(tokenizer, [a]) as rr:
            out = {}
            for path in ("/dashboard", "/dashboard/", "/dashboard/app.js", "/dashboard/style.css"):
                resp = await rr.client.get(rr.url + path)
                out[path] = (resp.status_code, resp.headers["content-type"], resp.text)
            return out

    assets = run(scenario())
    assert {path: status for path, (status, _, _) in assets.items()} == dict.fromkeys(assets, 200)
    assert assets["/dashboard/app.js"][1].startswith("text/javascript")
    for _, _, text in assets.values():
        # nothing from another host (the SVG namespace is a name, never fetched)
        assert set(re.findall(r"https?://[^\s\"')]+", text)) <= {"http://www.w3.org/2000/svg"}
        assert all(
            ref.startswith("/dashboard/") for ref in re.findall(r'(?:src|href)="([^"]+)"', text)
        )
    assert 'const FEED = "/dashboard/data";' in assets["/dashboard/app.js"][2]


class Rendered(HTMLParser):
    """data-* values of the rendered page: KPIs by name, replica fields by (replica, field)."""

    def __init__(self) -> None:
        super().__init__()
        self.kpis: dict[str, str] = {}
        self.fields: dict[tuple[str, str], str] = {}
        self.attrs_of: dict[str, dict[str, str]] = {}
        self._replica = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "data-replica" in a:
            self._replica = a["data-replica"]
        if "data-kpi" in a:
            self.kpis[a["data-kpi"]] = a.get("data-value", "")
        if "data-field" in a:
            self.fields[(self._replica, a["data-field"])] = a.get("data-value", "")
        if "id" in a:
            self.attrs_of[a["id"]] = a


def rendered(dom: str) -> Rendered:
    page = Rendered()
    page.feed(dom)
    return page


def chromium_or_skip() -> None:
    try:
        require_binary("chromium")
    except ConfigError as exc:
        pytest.skip(str(exc))


def test_chromium_shows_the_figures_of_the_metrics_during_a_workload(
    tokenizer: Tokenizer,
) -> None:
    """The page is loaded while requests keep arriving: every counter it shows lies between
    the router's /metrics read just before and just after the load."""
    chromium_or_skip()

    def counters(text: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in text.splitlines():
            for name in (
                "kvtier_router_prompt_tokens_total",
                "kvtier_router_cached_tokens_total",
                "kvtier_router_routed_total",
            ):
                if line.startswith(name):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            if line.startswith('kvtier_router_requests_total{endpoint="/v1/completions"'):
                if 'status="200"' in line:
                    out["requests"] = float(line.rsplit(" ", 1)[1])
        return out

    async def scenario() -> tuple[dict[str, float], str, dict[str, float], str, str]:
        a, b = fleet()
        async with metered_fleet(a, b), running_router(tokenizer, [a, b]) as rr:
            stop = asyncio.Event()

            async def workload() -> None:
                i = 0
                while not stop.is_set():
                    body = completion(f"request {i}", stream=True)
                    await rr.client.post(rr.url + "/v1/completions", json=body)
                    i += 1
                    await asyncio.sleep(0.02)

            task = asyncio.create_task(workload())
            await asyncio.sleep(1.0)
            before = counters((await rr.client.get(rr.url + "/metrics")).text)
            dom = await asyncio.to_thread(capture_dashboard, rr.url + "/dashboard", wait_ms=3000)
            after = counters((await rr.client.get(rr.url + "/metrics")).text)
            stop.set()
            await task
            return before, dom, after, a.url, b.url

    before, dom, after, a_url, b_url = run(scenario(), timeout_s=120)
    page = rendered(dom)
    assert "data-error" not in page.attrs_of["status"], page.attrs_of["status"]
    assert page.attrs_of["status"]["class"] == "status ok"
    assert before["requests"] > 0 and after["requests"] > before["requests"]
    shown = {k: float(v) for k, v in page.kpis.items() if v}
    assert before["requests"] <= shown["requests"] <= after["requests"]
    prompt = "kvtier_router_prompt_tokens_total"
    assert before[prompt] <= shown["prompt_tokens"] <= after[prompt]
    assert shown["errors"] == 0
    assert 0 < shown["ttft_p50_ms"] <= shown["ttft_p90_ms"]
    cached = "kvtier_router_cached_tokens_total"
    assert before[cached] <= shown["cached_tokens"] <= after[cached]
    routed = sum(float(page.fields[(url, "routed")]) for url in (a_url, b_url))
    assert before["kvtier_router_routed_total"] <= routed <= after["kvtier_router_routed_total"]
    assert page.fields[(a_url, "healthy")] == "true"
    assert float(page.fields[(a_url, "l1_occupancy")]) == 0.25
    assert float(page.fields[(b_url, "l1_occupancy")]) == 0.5
    assert float(page.attrs_of["l2-summary"]["data-value"]) == 60 * MiB


def test_samples_that_are_not_finite_numbers_are_left_out() -> None:
    """A replica's NaN or Inf would make the dashboard's feed invalid JSON for the whole fleet."""
    page = b'a{engine="0"} NaN\na{engine="1"} +Inf\na{engine="2"} -Inf\na{engine="3"} 0.5\n'
    assert parse_samples(page, (b"a",)) == [("a", {"engine": "3"}, 0.5)]
