"""The dashboard's sampler against fake replicas on loopback: the fleet changing while a sample
is in flight, rates across a replica's restart or a missed scrape, and a replica of several
data-parallel engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from kvtier.net.http_client import HttpPool
from kvtier.router.dashboard.sampler import L2_FIELDS, FleetSampler
from kvtier.router.metrics import RouterMetrics
from kvtier.router.replicas import ReplicaSet
from kvtier.router.settings import ReplicaSettings
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.fake_replica import _respond
from tests.helpers.aio import run
from tests.helpers.router import MAX_MODEL_LEN, MODEL, running_router
from tests.monitoring.fake_vllm import SERIES, MeteredReplica, metered_fleet


@dataclass
class SlowMetrics(MeteredReplica):
    """Answers /metrics after `metrics_delay_s`, or 503 while `metrics_down`."""

    metrics_delay_s: float = 0.0
    metrics_down: bool = False

    async def _answer(
        self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes
    ) -> bool:
        if method == "GET" and path == "/metrics":
            await asyncio.sleep(self.metrics_delay_s)
            if self.metrics_down:
                await _respond(writer, 503, b"down", b"text/plain")
                return True
        return await super()._answer(writer, method, path, body)


@dataclass
class DataParallel(MeteredReplica):
    """One API server in front of two engines (`--data-parallel-size 2`): every series once
    per engine, `figures` for engine 0 and `figures1` for engine 1."""

    figures1: dict[str, float] | None = None

    def metrics_text(self) -> str:
        lines = []
        for engine, figures in enumerate((self.figures, self.figures1 or {})):
            labels = f'engine="{engine}",model_name="smol"'
            lines += [f"{SERIES[k] % labels} {v}" for k, v in figures.items()]
        return "\n".join(lines) + "\n"


def replica(**options: Any) -> SlowMetrics:
    return SlowMetrics(model=MODEL, max_model_len=MAX_MODEL_LEN, block_tokens=16, **options)


def test_a_replica_leaving_while_a_sample_is_in_flight_does_not_break_the_feed(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        a = replica(metrics_delay_s=1.0, figures={"prompt_tokens": 10})
        b = replica(figures={"prompt_tokens": 20})
        async with metered_fleet(a, b), running_router(tokenizer, [a, b]) as rr:
            asking = asyncio.create_task(rr.client.get(rr.url + "/dashboard/data/latest"))
            await asyncio.sleep(0.3)  # the sample waits on A's /metrics
            assert rr.router.replicas.remove(b.url) is not None  # as discovery does
            resp = await asking
            assert resp.status_code == 200
            doc = resp.json()
            # the sample shows the fleet as it was when it began, each replica its own page
            names = {r["name"]: r for r in doc["replicas"]}
            assert set(names) == {a.url, b.url}
            assert names[a.url]["tokens"]["computed"] == 10
            assert names[b.url]["tokens"]["computed"] == 20

    run(scenario(), timeout_s=30)


def test_rates_skip_a_missed_scrape_and_count_a_restarted_replica_from_zero() -> None:
    async def scenario() -> list[dict[str, Any]]:
        l2 = {"l2_capacity_bytes": 1 << 20}
        a = replica(figures={"prompt_tokens": 1000, "l0_tokens": 500, "l2_evicted_blocks": 7, **l2})
        b = replica(figures={"prompt_tokens": 600, "l0_tokens": 100, "l2_evicted_blocks": 0, **l2})
        async with metered_fleet(a, b):
            replicas = ReplicaSet((ReplicaSettings(url=a.url), ReplicaSettings(url=b.url)))
            now = [0.0]
            sampler = FleetSampler(
                RouterMetrics(replicas, "x", dict),
                replicas,
                idle_stop_s=0.0,  # no background task: a sample only when asked
                clock=lambda: now[0],
            )
            pool = HttpPool(1.0, 1.0)
            sampler.start(pool)
            try:

                async def sample() -> dict[str, Any]:
                    now[0] += 1.0
                    return (await sampler.current()).point

                await sample()
                # 1 s later: A misses its scrape, B served 10 tokens from L0, 5 computed
                a.metrics_down = True
                b.figures.update(prompt_tokens=615, l0_tokens=110)
                missed = await sample()
                # A is back, B served 10 more tokens, all computed
                a.metrics_down = False
                b.figures.update(prompt_tokens=625)
                back = await sample()
                # A restarted (its counters from zero): 40 tokens since, 30 from L0; B idle
                a.figures.update(prompt_tokens=40, l0_tokens=30, l2_evicted_blocks=2)
                restarted = await sample()
            finally:
                pool.close()
                await sampler.stop()
            return [missed, back, restarted]

    missed, back, restarted = run(scenario(), timeout_s=30)
    assert missed["tokens_per_s"] == {"l0": 10.0, "l1": 0.0, "l2": 0.0, "computed": 5.0}
    # not A's whole history (1,000 tokens) as if served in that second
    assert back["tokens_per_s"] == {"l0": 0.0, "l1": 0.0, "l2": 0.0, "computed": 10.0}
    assert back["l2_evicted_blocks"] == 0
    # not zero because the fleet's sum went down
    assert restarted["tokens_per_s"] == {"l0": 30.0, "l1": 0.0, "l2": 0.0, "computed": 10.0}
    assert restarted["l2_evicted_blocks"] == 2


def test_a_replica_of_two_engines_reports_one_l2_pool_and_its_cache_occupancy(
    tokenizer: Tokenizer,
) -> None:
    """Each engine's connector reports the shared pool: counted once, not once per engine."""
    l2 = {"l2_used_bytes": 60, "l2_capacity_bytes": 100, "l2_high_bytes": 90, "l2_low_bytes": 75}
    engine0 = {"prompt_tokens": 100, "l0_tokens": 40, "l0_usage": 0.8, "running": 2, **l2}
    engine1 = {"prompt_tokens": 50, "l0_tokens": 10, "l0_usage": 0.4, "running": 1, **l2}
    engine0.update(l2_blocks=12, l2_lease_held=1, l1_used_bytes=1, l1_capacity_bytes=4)
    engine1.update(l2_blocks=12, l2_lease_held=0, l1_used_bytes=2, l1_capacity_bytes=4)

    async def scenario() -> dict[str, Any]:
        dp = DataParallel(
            model=MODEL, max_model_len=MAX_MODEL_LEN, figures=engine0, figures1=engine1
        )
        async with metered_fleet(dp), running_router(tokenizer, [dp]) as rr:
            doc: dict[str, Any] = (await rr.client.get(rr.url + "/dashboard/data")).json()
            return doc

    doc = run(scenario(), timeout_s=30)
    assert {k: doc["l2"][k] for k in L2_FIELDS} == {
        "used_bytes": 60,
        "capacity_bytes": 100,
        "high_bytes": 90,
        "low_bytes": 75,
        "blocks": 12,
    }
    (r,) = doc["replicas"]
    assert r["l0_usage"] == pytest.approx(0.6)  # of both engines' caches, not 120%
    assert r["lease_held"] is True
    # what each engine has of its own adds up
    assert (r["running"], r["l1_used_bytes"], r["l1_capacity_bytes"]) == (3, 3, 8)
    assert r["tokens"] == {"l0": 50, "l1": 0, "l2": 0, "computed": 100}
