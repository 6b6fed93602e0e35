"""The saturation benchmark's parts: its prompts, its closed loop, its load generator
processes, its rows, and its refusals of cores it cannot use."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.tools.bench.router_peers import start_fake_replica
from kvtier.tools.bench.router_saturation import (
    DIRECT,
    Target,
    build_prompts,
    closed_loop,
    measure,
    scaled,
    summarize,
)
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


def test_generator_processes_load_every_url_and_rows_of_several_get_their_scale_out(
    tmp_path: Path,
) -> None:
    procs, urls = [], []
    try:
        for _ in range(2):
            proc, url = start_fake_replica(tmp_path)
            procs.append(proc)
            urls.append(url)
        one = Target(DIRECT, urls[:1], [procs[0].pid])
        two = scaled(one, urls, [p.pid for p in procs])
        args = argparse.Namespace(rounds=2, concurrency=2, seconds=0.5)
        rows = {row["router"]: row for row in measure([one, two], ["a", "b", "c"], args)}
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    alone, together = rows[DIRECT], rows["direct x2"]
    assert alone["failed"] == together["failed"] == 0
    assert alone["rps_median"] > 0 and together["rps_median"] > 0
    assert "scale_out" not in alone
    assert together["scale_out"] == round(together["rps_median"] / alone["rps_median"], 2)
    # the fakes served: each process's share of its core is measured, and positive
    assert 0 < alone["router_cpu_share"] and 0 < together["router_cpu_share"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--processes", "2", "--router-cpus", "0"], "--processes 2: needs as many cores"),
        (["--router-cpus", "0,x"], "--router-cpus: expected CPU ids like 0,2-3, got '0,x'"),
        (["--harness-cpus", "4096"], "--harness-cpus: no core 4096 here"),
        (["--replicas", "0"], "--replicas: at least 1"),
    ],
)
def test_cores_it_cannot_use_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    out = tmp_path / "rows.json"
    assert main(["bench", "router-saturation", "--json", str(out), *options]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
