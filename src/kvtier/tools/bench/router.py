"""Benchmark S3: routers side by side on the same replicas, in one run.

    kvtier bench router --json bench_router.json

Workload: `prefixes` distinct `prefix_tokens`-token documents x `suffixes` short questions
(optionally each after `suffix_tokens` of unique context, optionally all after one shared
`system_tokens` system prompt), interleaved in rounds (every prefix once per round, each round
in a fresh seeded order), streamed with `concurrency` requests in flight, against 2 vLLM
replicas (1 thread each, cores 0 and 1; `engine_blocks` caps their own KV caches). Each router
gets fresh prompts, so none profits from another's warm cache. Per router (one row):

- affinity: prefix-cache hit tokens the replicas report (`vllm:prefix_cache_hits`) over the
  most they could have (each request hitting every full block it shares with any earlier
  request): the fraction of reusable prefill that landed where it was cached;
- load_max_min: most over fewest requests finished per replica (`vllm:request_success`);
- ttft_p50_ms: nearest-rank p50 of the time to first token through the router (of an even
  number of requests, the lower of the two middle ones); null if no request succeeded;
- overhead_p50_ms / overhead_p99_ms: the router's added latency, measured in front of two fast
  fake replicas (separate process) as the paired difference router - direct over sequential
  requests with the same prompts: pure routing cost, free of engine noise. Every router runs
  in front of the fakes at once and they take turns, 20 pairs each, so background load on
  the machine weighs on all of them alike while each serves warm, as under steady traffic;
- overhead_cold_p50_ms / overhead_cold_p99_ms: the same with turns of one pair, so each router
  idles while the others serve, as at a trickle of traffic: about twice the warm figure for
  every router on 2 cores (most likely cold CPU caches).

A last row, "passthrough", gives the same figures for a proxy on kvtier's own HTTP stack
(`HttpServer`, `HttpPool` client) that neither parses nor routes: the floor of that stack on
this machine now, so kvtier's overhead minus it is the routing work, and absolute figures can be
compared across machines of different speed.

Peers: the cache-aware modes of `sglang-router` and `vllm-router` (PyPI), when installed; a
peer that cannot be started records the exact reason in its row's "error".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError
from kvtier.net.http_client import HttpPool
from kvtier.net.ports import free_port
from kvtier.tools.bench.router_peers import (
    PASSTHROUGH,
    ROUTERS,
    Replica,
    RouterProcess,
    start_fake_replica,
    stop_fake_replica,
)
from kvtier.tools.bench.router_workload import Workload, build_workload

__all__ = ["register"]

WARM_STREAK = 20
"""Consecutive overhead pairs per router per turn in the warm measurement."""


# ----- measurements -----


async def _scrape(pool: HttpPool, url: str) -> dict[str, float]:
    resp = await pool.get(url, "/metrics")
    try:
        text = (await resp.read()).decode()
    finally:
        resp.close()
    out = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:request_success_total"):
        out[name] = sum(
            float(v)
            for v in re.findall(
                rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE
            )
        )
    return out


async def run_workload(
    router_url: str, replicas: Sequence[str], model: str, workload: Workload, concurrency: int
) -> dict[str, Any]:
    from kvtier.tools.bench.client import new_pool, stream_request
    from kvtier.tools.bench.report import percentile

    session = new_pool()
    try:
        before = [await _scrape(session, r) for r in replicas]
        gate = asyncio.Semaphore(concurrency)
        ttfts: list[float] = []
        errors: list[str] = []

        async def one(prompt: str) -> None:
            async with gate:
                try:
                    outcome = await stream_request(
                        session,
                        router_url,
                        {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
                    )
                    ttfts.append(outcome.ttft_ms)
                except Exception as exc:  # noqa: BLE001 - a failed request is a figure too
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        tasks = []
        for prompt in workload.prompts:  # start in order: the interleaving is the workload
            tasks.append(asyncio.create_task(one(prompt)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)  # let the counters settle
        after = [await _scrape(session, r) for r in replicas]
    finally:
        session.close()
    hits = sum(
        a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
        for a, b in zip(after, before, strict=True)
    )
    load = [
        a["vllm:request_success_total"] - b["vllm:request_success_total"]
        for a, b in zip(after, before, strict=True)
    ]
    row: dict[str, Any] = {
        "affinity": round(hits / workload.ideal_hit_tokens, 4)
        if workload.ideal_hit_tokens
        else None,
        "load_max_min": round(max(load) / min(load), 3) if min(load) > 0 else None,
        "load": load,
        "ttft_p50_ms": round(percentile(ttfts, 50), 2) if ttfts else None,
        "requests": len(workload.prompts),
        "failed": len(errors),
    }
    if errors:
        row["error"] = errors[0]
    return row


async def measure_overhead(
    router_urls: Mapping[str, str],
    direct_url: str,
    prompts: Sequence[str],
    pairs: int,
    streak: int = 1,
    prefix: str = "overhead",
) -> dict[str, dict[str, float]]:
    """Per router, paired (router - direct) latency of sequential non-streaming requests, as
    `{prefix}_p50_ms` and `{prefix}_p99_ms` (nearest rank).

    The routers take turns, `streak` pairs each (a pair: direct, then through the router), so
    the machine's drifting background load weighs on every router alike. With a streak of 1 a
    router's process idles while the others serve (as at a trickle of traffic; it then pays
    about twice as much, most likely for cold CPU caches); a longer streak measures it warm, as
    under steady traffic."""
    from kvtier.tools.bench.client import new_pool, post_json
    from kvtier.tools.bench.report import percentile

    diffs: dict[str, list[float]] = {name: [] for name in router_urls}
    session = new_pool()

    async def timed(url: str, prompt: str) -> float:
        start = time.perf_counter()
        resp = await post_json(
            session, url, "/v1/completions", {"model": "fake", "prompt": prompt, "max_tokens": 4}
        )
        try:
            await resp.read()
        finally:
            resp.close()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
        return time.perf_counter() - start

    try:
        warmup = 30
        for turn in range(0, pairs + warmup, streak):
            for name, url in router_urls.items():
                for i in range(turn, min(turn + streak, pairs + warmup)):
                    prompt = prompts[i % len(prompts)]
                    direct = await timed(direct_url, prompt)
                    routed = await timed(url, prompt)
                    if i >= warmup:
                        diffs[name].append(1000 * (routed - direct))
    finally:
        session.close()
    return {
        name: {
            f"{prefix}_p50_ms": round(percentile(d, 50), 3),
            f"{prefix}_p99_ms": round(percentile(d, 99), 3),
        }
        for name, d in diffs.items()
    }


# ----- orchestration -----


def start_replicas(model: str, work_dir: Path, engine_blocks: int | None = None) -> list[Any]:
    """Two single-threaded replicas on cores 0 and 1 publishing vLLM KV events; `engine_blocks`
    caps each one's own KV cache (a small GPU's HBM)."""
    from kvtier.tools.vllm_server import ServerProcess, ServerSpec

    servers = []
    for i in range(2):
        events = f"ipc://{work_dir}/kv-events-{i}"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "topic": "kv",
        }
        extra = ["--kv-events-config", json.dumps(config)]
        if engine_blocks:
            extra += ["--num-gpu-blocks-override", str(engine_blocks)]
        spec = ServerSpec(
            model=model,
            port=free_port(),
            threads=1,
            cpu_ids=str(i),
            max_model_len=-1 if engine_blocks else 4096,
            extra_args=extra,
            log_path=work_dir / f"vllm-{i}.log",
        )
        servers.append((ServerProcess(spec), events))
    try:
        for server, _ in servers:
            server.wait_healthy(600)
    except BaseException:
        for server, _ in servers:
            server.stop()
        raise
    return servers


async def bench_one(
    name: str,
    replicas: list[Replica],
    model: str,
    workload: Workload,
    args: argparse.Namespace,
    work_dir: Path,
) -> dict[str, Any]:
    """One router's row from the workload on the real replicas."""
    row: dict[str, Any] = {"router": name}
    try:
        router = RouterProcess(name, replicas, work_dir)
        try:
            await router.ready()
            row.update(
                await run_workload(
                    router.url, [r.url for r in replicas], model, workload, args.concurrency
                )
            )
        finally:
            router.stop()
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is recorded, not fatal
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    print(json.dumps(row), flush=True)
    return row


async def bench_overheads(
    names: Sequence[str], fakes: list[Replica], prompts: Sequence[str], pairs: int, work_dir: Path
) -> dict[str, dict[str, Any]]:
    """Every router in front of the fake replicas at once, measured in turns: warm (turns of
    `WARM_STREAK` pairs) as `overhead_*`, then cold (one pair per turn) as `overhead_cold_*`."""
    started: dict[str, RouterProcess] = {}
    out: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            try:
                router = RouterProcess(name, fakes, work_dir)
                started[name] = router
                await router.ready()
            except Exception as exc:  # noqa: BLE001 - recorded in the row, not fatal
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        ready = {name: r.url for name, r in started.items() if name not in out}
        if ready:
            warm = await measure_overhead(ready, fakes[0].url, prompts, pairs, WARM_STREAK)
            cold = await measure_overhead(ready, fakes[0].url, prompts, pairs, 1, "overhead_cold")
            out.update({name: {**warm[name], **cold[name]} for name in ready})
    finally:
        for router in started.values():
            router.stop()
    return out


def _cmd(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from kvtier.router.health import engine_block_tokens
    from kvtier.tools.bench.client import call
    from kvtier.tools.bench.corpus import Corpus
    from kvtier.tools.bench.report import write_json
    from kvtier.tools.embedded_model import resolve_model

    model_dir = resolve_model(args.model)
    model = Path(model_dir).name
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = Corpus(tokenizer)
    fake_procs: list[tuple[subprocess.Popen[bytes], str]] = []
    servers: list[tuple[Any, str]] = []
    rows = []
    try:
        for _ in range(2):
            fake_procs.append(start_fake_replica(work_dir))
        servers = start_replicas(model_dir, work_dir, args.engine_blocks)
        replicas = [Replica(s.url, events) for s, events in servers]
        fakes = [Replica(url) for _, url in fake_procs]
        block_tokens = engine_block_tokens(call(replicas[0].url, "/metrics")[1])
        if block_tokens is None:
            raise KvtierError(f"{replicas[0].url}/metrics: no vllm:cache_config_info block_size")
        for i, name in enumerate(args.routers):
            workload = build_workload(
                tokenizer,
                corpus,
                f"r{i}",
                args.prefixes,
                args.suffixes,
                args.prefix_tokens,
                args.suffix_tokens,
                args.system_tokens,
                block_tokens=block_tokens,
            )
            rows.append(asyncio.run(bench_one(name, replicas, model, workload, args, work_dir)))
        overheads = asyncio.run(
            bench_overheads(
                [*args.routers, PASSTHROUGH], fakes, workload.prompts, args.overhead_pairs, work_dir
            )
        )
        for row in rows:
            extra = dict(overheads.get(row["router"], {}))
            if "error" in extra:
                row["overhead_error"] = extra.pop("error")
            row.update(extra)
            print(json.dumps(row), flush=True)
        rows.append({"router": PASSTHROUGH, **overheads[PASSTHROUGH]})
        print(json.dumps(rows[-1]), flush=True)
    finally:
        for proc, _ in fake_procs:  # first: a second Ctrl-C may cut the replicas' stop short
            stop_fake_replica(proc)
        for server, _ in servers:
            server.stop()
    write_json(rows, Path(args.json))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "router",
        help="S3: kvtier's router vs round robin, least load, sglang-router and "
        "vllm-router on 2 replicas",
        description="Shared-prefix workload (distinct documents x questions, interleaved) "
        "through each router in front of the same 2 vLLM replicas: affinity from "
        "the replicas' prefix-cache counters, load spread, TTFT, and the router's "
        "added latency measured against fast fake replicas.",
    )
    p.add_argument("--json", required=True, metavar="FILE", help="write the rows here")
    p.add_argument(
        "--routers",
        nargs="+",
        choices=ROUTERS,
        default=list(ROUTERS),
        help="routers to compare (default: all)",
    )
    p.add_argument("--prefixes", type=int, default=8, help="distinct prefixes (default 8)")
    p.add_argument("--suffixes", type=int, default=6, help="questions per prefix (default 6)")
    p.add_argument(
        "--prefix-tokens", type=int, default=1024, help="tokens per prefix (default 1024)"
    )
    p.add_argument(
        "--suffix-tokens",
        type=int,
        default=0,
        help="tokens of unique context before each question (default 0: short "
        "questions only); e.g. 1300 after 512-token prefixes makes the shared "
        "part ~28%% of each prompt, as in RAG or agent traffic",
    )
    p.add_argument(
        "--system-tokens",
        type=int,
        default=0,
        help="tokens of one system prompt opening every request, before its "
        "document (default 0); a shared head makes cache-aware routers that "
        "follow the longest match pile every new document onto one replica",
    )
    p.add_argument(
        "--engine-blocks",
        type=int,
        metavar="N",
        help="each replica's own KV cache in engine blocks (default: 1 GiB, "
        "~360 blocks); a small cache makes a replica that takes more than its "
        "share of documents evict them",
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument(
        "--overhead-pairs",
        type=int,
        default=400,
        help="paired direct/routed requests for the overhead figure (default 400)",
    )
    p.add_argument("--model", metavar="DIR", help="HF model dir (default: embedded model)")
    p.add_argument(
        "--work-dir",
        default=".kvtier/bench-router",
        help="logs and event sockets (default .kvtier/bench-router)",
    )
    p.set_defaults(func=_cmd)
