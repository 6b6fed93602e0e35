"""The saturation benchmark's parts: its prompts, its closed loop, its rows."""

from __future__ import annotations

import asyncio

from kvtier.tools.bench.router_saturation import build_prompts, closed_loop, summarize
from kvtier.tools.fake_replica import FakeReplica


class _Corpus:
    def document(self, n_tokens: int, seed: int) -> str:
        return f"document {seed} of {n_tokens} tokens"


def test_prompts_are_distinct_and_open_with_one_of_the_shared_documents() -> None:
    prompts = build_prompts(_Corpus(), prefixes=3, prompt_tokens=64, count=30)
    assert len(set(prompts)) == 30
    heads = {p.split("\n\n")[0] for p in prompts}
    assert heads == {f"document {9000 + k} of 64 tokens" for k in range(3)}


def test_the_closed_loop_counts_answers_and_failures() -> None:
    async def scenario(mode: str) -> tuple[int, int]:
        fake = await FakeReplica(mode=mode).start()
        try:
            return await closed_loop(fake.url, ["a", "b"], concurrency=4, seconds=0.3)
        finally:
            await fake.stop()

    ok, failed = asyncio.run(scenario("ok"))
    assert ok > 0 and failed == 0
    ok, failed = asyncio.run(scenario("error500"))
    assert ok == 0 and failed > 0


def test_a_row_gives_the_median_and_spread_of_the_turns() -> None:
    turns = [
        {"rps": 100.0, "failed": 0.0, "cpu_share": 0.9},
        {"rps": 300.0, "failed": 1.0, "cpu_share": 1.0},
        {"rps": 200.0, "failed": 0.0, "cpu_share": 0.95},
    ]
    row = summarize("r", turns)
    assert (row["rps_median"], row["rps_min"], row["rps_max"]) == (200.0, 100.0, 300.0)
    assert row["failed"] == 1 and row["router_cpu_share"] == 0.95
    assert "router_cpu_share" not in summarize("direct", [{"rps": 1.0, "failed": 0.0}])
