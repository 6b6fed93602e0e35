"""Router saturation: requests per second one router process serves on one core.

    kvtier bench router-saturation --json saturation.json

Every router under test (kvtier's strategies, sglang-router and vllm-router when installed)
runs at once, each pinned to `--router-cpu` (its threads and children inherit the affinity, so
the Rust routers' runtimes see one core), in front of two fake replicas
(`kvtier.tools.fake_replica`, answering at once) pinned to `--harness-cpus` with the load
generator. In turns, `--rounds` times over, each router gets a closed loop of `--concurrency`
keep-alive clients sending non-streaming completions for `--seconds` (after one second of
warm-up): distinct prompts, `--prefixes` shared documents of `--prompt-tokens` tokens each
followed by a question of its own, so no router profits from repeating one text.

Row per router: the median requests/s of its turns, the min-max, the share of its core it
used (about 1.0 when it is the bottleneck), and failed requests. The row "direct" is the same
load on one fake replica without a router: the harness's own ceiling. A router within ~10% of
it is bounded by the harness, not by itself, and its figure is a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from kvtier.tools.bench.monitoring_cost import cpu_seconds
from kvtier.tools.bench.router_peers import Replica, RouterProcess, start_fake_replica

__all__ = ["register"]

DIRECT = "direct"
SATURATION_ROUTERS = ("kvtier-kvaware", "kvtier-prefixaware", "sglang-router", "vllm-router")


def build_prompts(corpus: Any, prefixes: int, prompt_tokens: int, count: int) -> list[str]:
    """`count` distinct prompts: one of `prefixes` documents, then a question of its own."""
    documents = [corpus.document(prompt_tokens, seed=9000 + p) for p in range(prefixes)]
    return [
        f"{documents[i % prefixes]}\n\nQuestion {i}: what does part {i % 97} say about case {i}?"
        for i in range(count)
    ]


async def closed_loop(
    url: str, prompts: Sequence[str], concurrency: int, seconds: float
) -> tuple[int, int]:
    """`concurrency` clients sending completions back to back for `seconds`; (ok, failed)."""
    from kvtier.tools.bench.client import new_pool, post_json

    pool = new_pool(30.0)
    ok = failed = 0
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal ok, failed
        i = k
        while time.perf_counter() < stop:
            body = {"model": "fake", "prompt": prompts[i % len(prompts)], "max_tokens": 4}
            try:
                resp = await post_json(pool, url, "/v1/completions", body)
                try:
                    await resp.read()
                finally:
                    resp.close()
            except OSError:
                failed += 1
            else:
                ok += resp.status == 200
                failed += resp.status != 200
            i += concurrency

    try:
        await asyncio.gather(*(client(k) for k in range(concurrency)))
    finally:
        pool.close()
    return ok, failed


async def one_turn(
    url: str, pid: int | None, prompts: Sequence[str], concurrency: int, seconds: float
) -> dict[str, float]:
    await closed_loop(url, prompts, concurrency, 1.0)  # warm-up: connections, caches
    cpu_before = cpu_seconds(psutil.Process(pid)) if pid is not None else 0.0
    start = time.perf_counter()
    ok, failed = await closed_loop(url, prompts, concurrency, seconds)
    elapsed = time.perf_counter() - start
    turn = {"rps": ok / elapsed, "failed": float(failed)}
    if pid is not None:
        turn["cpu_share"] = (cpu_seconds(psutil.Process(pid)) - cpu_before) / elapsed
    return turn


def summarize(name: str, turns: Sequence[dict[str, float]]) -> dict[str, Any]:
    rps = [t["rps"] for t in turns]
    row: dict[str, Any] = {
        "router": name,
        "rps_median": round(statistics.median(rps), 1),
        "rps_min": round(min(rps), 1),
        "rps_max": round(max(rps), 1),
        "failed": int(sum(t["failed"] for t in turns)),
    }
    if all("cpu_share" in t for t in turns):
        row["router_cpu_share"] = round(statistics.median(t["cpu_share"] for t in turns), 2)
    return row


async def measure(
    routers: dict[str, RouterProcess],
    direct_url: str,
    prompts: Sequence[str],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    turns: dict[str, list[dict[str, float]]] = {name: [] for name in [DIRECT, *routers]}
    for _ in range(args.rounds):
        for name in turns:
            router = routers.get(name)
            url = router.url if router else direct_url
            pid = router.pid if router else None
            turns[name].append(await one_turn(url, pid, prompts, args.concurrency, args.seconds))
    return [summarize(name, t) for name, t in turns.items()]


def _cmd(args: argparse.Namespace) -> int:
    import json
    import signal

    from transformers import AutoTokenizer

    from kvtier.tools.bench.corpus import Corpus
    from kvtier.tools.bench.report import write_json
    from kvtier.tools.embedded_model import resolve_model

    router_cpus = {args.router_cpu}
    harness_cpus = {int(c) for c in args.harness_cpus.split(",")}
    corpus = Corpus(AutoTokenizer.from_pretrained(resolve_model(None)))
    prompts = build_prompts(corpus, args.prefixes, args.prompt_tokens, 4096)
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, harness_cpus)  # the load generator (this process)
    fakes = [start_fake_replica(work_dir, harness_cpus) for _ in range(2)]
    routers: dict[str, RouterProcess] = {}
    rows: list[dict[str, Any]] = []
    try:
        replicas = [Replica(url) for _, url in fakes]
        for name in args.routers:
            try:
                router = RouterProcess(name, replicas, work_dir, router_cpus)
                routers[name] = router
                asyncio.run(router.ready())
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is recorded
                rows.append({"router": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
                if name in routers:
                    routers.pop(name).stop()
        rows = asyncio.run(measure(routers, fakes[0][1], prompts, args)) + rows
    finally:
        for router in routers.values():
            router.stop()
        for proc, _ in fakes:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for row in rows:
        print(json.dumps(row), flush=True)
    write_json(rows, Path(args.json))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "router-saturation",
        help="requests/s of each router on one core, in front of fake replicas",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", required=True, metavar="FILE", help="write the rows here")
    p.add_argument(
        "--routers",
        nargs="+",
        default=list(SATURATION_ROUTERS),
        choices=SATURATION_ROUTERS,
        help="routers to compare (default: all; peers not installed get an error row)",
    )
    p.add_argument("--router-cpu", type=int, default=0, help="the routers' core (default 0)")
    p.add_argument(
        "--harness-cpus",
        default="1",
        help="cores of the fake replicas and the load generator, comma-separated (default 1)",
    )
    p.add_argument("--concurrency", type=int, default=32, help="clients (default 32)")
    p.add_argument("--seconds", type=float, default=10.0, help="load per turn (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="turns per router (default 3)")
    p.add_argument("--prefixes", type=int, default=8, help="shared documents (default 8)")
    p.add_argument(
        "--prompt-tokens", type=int, default=1024, help="tokens per document (default 1024)"
    )
    p.add_argument(
        "--work-dir",
        default=".kvtier/bench-router-saturation",
        help="logs (default .kvtier/bench-router-saturation)",
    )
    p.set_defaults(func=_cmd)
