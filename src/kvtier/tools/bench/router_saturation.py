"""Router saturation: requests per second one router process serves on one core.

    kvtier bench router-saturation --json saturation.json

Every router under test (kvtier's strategies, sglang-router and vllm-router when installed)
runs at once, each pinned to the lowest of `--router-cpus` (its threads and children inherit the
affinity, so the Rust routers' runtimes see one core), in front of `--replicas` fake replicas
(`kvtier.tools.fake_replica`, answering at once) pinned to `--harness-cpus` with the load
generator. In turns, `--rounds` times over, each router gets a closed loop of `--concurrency`
keep-alive clients sending non-streaming completions for `--seconds` (after one second of
warm-up): distinct prompts, `--prefixes` shared documents of `--prompt-tokens` tokens each
followed by a question of its own, so no router profits from repeating one text.

Row per router: the median requests/s of its turns, the min-max, the share of its core it
used (about 1.0 when it is the bottleneck), and failed requests. The row "direct" is the same
load on one fake replica without a router: the harness's own ceiling. A router within ~10% of
it is bounded by the harness, not by itself, and its figure is a lower bound.

Scale-out (`--processes N`): every kvtier router also runs as N processes in front of the same
replicas, process i alone on the i-th lowest core of `--router-cpus`, each driven by a load
generator of its own (as a Service spreads connections over router pods), and is measured in
the same turns as row "NAME xN": the requests/s of all N together and `scale_out`, their ratio
to the one-process row. "direct xN" is the harness's ceiling with N generators. The generators
run in processes of their own (`--processes` of them, on the harness's cores), one per router
process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from kvtier.core.errors import KvtierError
from kvtier.tools.bench.monitoring_cost import cpu_seconds
from kvtier.tools.bench.router_peers import Replica, RouterProcess, start_fake_replica
from kvtier.vllm.settings import parse_cpu_list

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


_PROMPTS: Sequence[str] = ()
"""The prompts of this load generator process (`_keep_prompts`)."""


def _keep_prompts(prompts: Sequence[str]) -> None:
    global _PROMPTS
    _PROMPTS = prompts


def _drive(url: str, concurrency: int, seconds: float) -> tuple[int, int, float]:
    """In a load generator process: `closed_loop` on `url`; (ok, failed, seconds it took)."""
    start = time.perf_counter()
    ok, failed = asyncio.run(closed_loop(url, _PROMPTS, concurrency, seconds))
    return ok, failed, time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class Target:
    """What one row measures: the URLs its generators load (one each), the router pids, and
    for several processes the row of one process they scale (`alone`)."""

    name: str
    urls: list[str]
    pids: list[int]
    alone: str | None = None


def one_turn(
    generators: Executor, target: Target, concurrency: int, seconds: float
) -> dict[str, float]:
    """One turn of load on `target`: a second of warm-up (connections, caches), then
    `seconds` measured, every URL by its own generator at once."""

    def drive_all(seconds: float) -> list[tuple[int, int, float]]:
        jobs = [generators.submit(_drive, url, concurrency, seconds) for url in target.urls]
        return [job.result() for job in jobs]

    drive_all(1.0)
    processes = [psutil.Process(pid) for pid in target.pids]
    cpu_before = sum(cpu_seconds(p) for p in processes)
    start = time.perf_counter()
    results = drive_all(seconds)
    elapsed = time.perf_counter() - start
    turn = {
        "rps": sum(ok / took for ok, _, took in results),
        "failed": float(sum(failed for _, failed, _ in results)),
    }
    if processes:
        used = sum(cpu_seconds(p) for p in processes) - cpu_before
        turn["cpu_share"] = used / elapsed / len(processes)
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


def measure(
    targets: Sequence[Target], prompts: Sequence[str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every target in turns, `args.rounds` times over; a row each (`summarize`), and on the
    rows of several processes `scale_out`, against the row of the same name alone."""
    turns: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
    spawn = multiprocessing.get_context("spawn")
    width = max(len(t.urls) for t in targets)
    with ProcessPoolExecutor(width, spawn, _keep_prompts, (prompts,)) as generators:
        for _ in range(args.rounds):
            for target in targets:
                turns[target.name].append(
                    one_turn(generators, target, args.concurrency, args.seconds)
                )
    rows = {name: summarize(name, t) for name, t in turns.items()}
    for target in targets:
        alone = rows.get(target.alone or "")
        if alone is not None and alone["rps_median"] > 0:
            scaled = rows[target.name]["rps_median"] / alone["rps_median"]
            rows[target.name]["scale_out"] = round(scaled, 2)
    return list(rows.values())


def scaled(target: Target, urls: list[str], pids: list[int]) -> Target:
    """The row of `target` served by several processes, one URL each."""
    return Target(f"{target.name} x{len(urls)}", urls, pids, target.name)


def _cpus(text: str, what: str) -> list[int]:
    """The cores of a list like "0,2-5", in order; a KvtierError naming `what` for a bad list
    or a core this process cannot run on."""
    try:
        cpus = sorted(parse_cpu_list(text))
    except ValueError as exc:
        raise KvtierError(f"{what}: {exc}") from None
    usable = os.sched_getaffinity(0)
    if missing := [c for c in cpus if c not in usable]:
        raise KvtierError(f"{what}: no core {missing[0]} here (usable: {sorted(usable)})")
    return cpus


def _cmd(args: argparse.Namespace) -> int:
    import json
    import signal

    from transformers import AutoTokenizer

    from kvtier.tools.bench.corpus import Corpus
    from kvtier.tools.bench.report import write_json
    from kvtier.tools.embedded_model import resolve_model

    router_cpus = _cpus(args.router_cpus, "--router-cpus")
    harness_cpus = set(_cpus(args.harness_cpus, "--harness-cpus"))
    if args.processes < 1:
        raise KvtierError(f"--processes: at least 1, got {args.processes}")
    if args.replicas < 1:
        raise KvtierError(f"--replicas: at least 1, got {args.replicas}")
    if args.processes > len(router_cpus):
        raise KvtierError(
            f"--processes {args.processes}: needs as many cores in --router-cpus, "
            f"got {args.router_cpus!r}"
        )
    corpus = Corpus(AutoTokenizer.from_pretrained(resolve_model(None)))
    prompts = build_prompts(corpus, args.prefixes, args.prompt_tokens, 4096)
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, harness_cpus)  # this process and the load generators it spawns
    fakes: list[tuple[subprocess.Popen[bytes], str]] = []
    started: list[RouterProcess] = []
    errors: list[dict[str, Any]] = []
    try:
        for _ in range(args.replicas):
            fakes.append(start_fake_replica(work_dir, harness_cpus))
        replicas = [Replica(url) for _, url in fakes]

        def start(name: str, cpu: int) -> RouterProcess:
            router = RouterProcess(name, replicas, work_dir, {cpu})
            started.append(router)
            asyncio.run(router.ready())
            return router

        direct = Target(DIRECT, [replicas[0].url], [])
        targets = [direct]
        if args.processes > 1:  # each generator on a fake of its own
            urls = [replicas[i % len(replicas)].url for i in range(args.processes)]
            targets.append(scaled(direct, urls, []))
        for name in args.routers:
            group = args.processes if name.startswith("kvtier-") else 1
            try:
                router = start(name, router_cpus[0])
                alone = Target(name, [router.url], [router.pid])
                targets.append(alone)
                if group > 1:
                    routers = [start(name, cpu) for cpu in router_cpus[:group]]
                    targets.append(
                        scaled(alone, [r.url for r in routers], [r.pid for r in routers])
                    )
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is recorded
                errors.append({"router": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
                targets = [t for t in targets if name not in (t.name, t.alone)]
        rows = measure(targets, prompts, args) + errors
    finally:
        for router in started:
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
    p.add_argument(
        "--router-cpus",
        default="0",
        help="the routers' cores, a list like 0,2-3: every router on the lowest, and with "
        "--processes N the i-th of a kvtier router's N processes on the i-th lowest (default 0)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="also run each kvtier router as this many processes, one per core of "
        "--router-cpus, each with its own load generator: the scale-out rows (default 1: none)",
    )
    p.add_argument(
        "--harness-cpus",
        default="1",
        help="cores of the fake replicas and the load generators, a list like 2-7 (default 1)",
    )
    p.add_argument(
        "--replicas", type=int, default=2, help="fake replicas behind every router (default 2)"
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
