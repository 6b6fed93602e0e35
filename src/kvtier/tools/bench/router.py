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
- ttft_p50_ms: median time to first token through the router;
- overhead_p50_ms / overhead_p99_ms: the router's added latency, measured in front of two fast
  fake replicas (separate process) as the paired difference router - direct over sequential
  requests with the same prompts: pure routing cost, free of engine noise. Every router runs
  in front of the fakes at once and they take turns, 20 pairs each, so background load on
  the machine weighs on all of them alike while each serves warm, as under steady traffic;
- overhead_cold_p50_ms / overhead_cold_p99_ms: the same with turns of one pair, so each router
  idles while the others serve, as at a trickle of traffic: about twice the warm figure for
  every router on 2 cores (most likely cold CPU caches).

A last row, "passthrough", gives the same figures for a proxy on kvtier's own HTTP stack
(uvicorn server, `HttpPool` client) that neither parses nor routes: the floor of that stack on
this machine now, so kvtier's overhead minus it is the routing work, and absolute figures can be
compared across machines of different speed.

Peers: the cache-aware modes of `sglang-router` and `vllm-router` (PyPI), when installed; a
peer that cannot be started records the exact reason in its row's "error".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError
from kvtier.net.http_client import HttpPool
from kvtier.net.ports import free_port
from kvtier.net.readiness import wait_ready

__all__ = ["register"]

ROUTERS = (
    "kvtier-prefixaware",
    "kvtier-kvaware",
    "roundrobin",
    "leastload",
    "sglang-router",
    "vllm-router",
)
PASSTHROUGH = "passthrough"
"""Overhead reference: kvtier's HTTP stack forwarding without parsing or routing."""
WARM_STREAK = 20
"""Consecutive overhead pairs per router per turn in the warm measurement."""


# ----- the routers under test -----


@dataclass(frozen=True, slots=True)
class Replica:
    url: str
    events: str | None = None
    """vLLM KV-event endpoint (kvaware only)."""


def router_command(name: str, replicas: Sequence[Replica], port: int) -> list[str]:
    """The command starting router `name` on `port` in front of `replicas`."""
    urls = [r.url for r in replicas]
    base = [sys.executable, "-m", "kvtier.cli", "router", "--port", str(port), "--seed", "0"]
    kvtier_strategy = {
        "kvtier-prefixaware": "prefixaware",
        "kvtier-kvaware": "kvaware",
        "roundrobin": "roundrobin",
        "leastload": "leastload",
    }
    if name == "kvtier-kvaware":
        return (
            base
            + ["--strategy", "kvaware"]
            + [
                a
                for r in replicas
                for a in ("--replica", r.url + (f"={r.events}" if r.events else ""))
            ]
        )
    if name in kvtier_strategy:
        return (
            base
            + ["--strategy", kvtier_strategy[name]]
            + [a for u in urls for a in ("--replica", u)]
        )
    # Both Rust routers open a Prometheus listener, by default on one fixed port (29000): give
    # each its own loopback port so several can run at once.
    rust_args = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        "cache_aware",
        "--worker-urls",
        *urls,
    ]
    if name == "sglang-router":
        return [sys.executable, "-m", "sglang_router.launch_router", *rust_args]
    if name == "vllm-router":
        exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
        return [exe, *rust_args]
    if name == PASSTHROUGH:
        return [
            sys.executable,
            "-m",
            "kvtier.tools.bench.router",
            "--passthrough",
            str(port),
            urls[0],
        ]
    raise ValueError(f"unknown router {name!r}")


class RouterProcess:
    """A router under test in its own process group; `stop()` ends the whole group."""

    def __init__(self, name: str, replicas: Sequence[Replica], log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"router-{name}-{self.port}.log"
        cmd = router_command(name, replicas, self.port)
        if name == "vllm-router" and not Path(cmd[0]).exists():
            raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, HF_HUB_OFFLINE="1"),
            )

    async def ready(self, timeout_s: float = 120.0) -> None:
        try:
            await asyncio.to_thread(
                wait_ready, self.url + "/health", timeout_s, exited=self._proc.poll, what=self.name
            )
        except KvtierError as exc:
            raise RuntimeError(f"{exc}: {self.log.read_text()[-400:].strip()}") from None

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue


def _passthrough_main(port: int, upstream: str) -> None:
    """Forward every completion to `upstream` untouched, on the router's own HTTP stack and
    event loop: the floor next to which the routers' overheads can be read."""
    from kvtier.net.http_client import HttpPool
    from kvtier.router.asgi import (
        JSON_HEADERS,
        Exchange,
        Receive,
        Scope,
        Send,
        fast_loop_factory,
        server,
    )

    pool = HttpPool(5.0, 60.0)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        exchange = Exchange(scope, receive, send)
        if exchange.path == "/health":
            await exchange.respond(200, b"ok", [])
            return
        body = await exchange.body(64 * 1024 * 1024)
        resp = await pool.post(
            upstream, "/v1/completions", body, [("Content-Type", "application/json")]
        )
        try:
            await exchange.respond(resp.status, await resp.read(), JSON_HEADERS)
        finally:
            resp.close()

    with asyncio.Runner(loop_factory=fast_loop_factory()) as runner:
        runner.run(server(app, "127.0.0.1", port).serve())


def start_fake_replica(log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log_dir / f"fake-{port}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.tools.fake_replica", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", 60, exited=proc.poll, what="the fake replica")
    return proc, url


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


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: tuple[str, ...]
    """Interleaved request prompts."""
    ideal_hit_tokens: int
    """Prefix-cache hit tokens if every request landed where its prefix was cached."""


def ideal_hit_tokens(prompts_ids: Sequence[Sequence[int]], block_tokens: int) -> int:
    """Prefix-cache hit tokens if every request landed where its longest earlier-seen prefix
    was cached: per request, the full blocks it shares with any earlier request (the engine
    always recomputes the last token, so a prompt's last token never counts)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for ids in prompts_ids:
        chain = [
            tuple(ids[: (k + 1) * block_tokens]) for k in range((len(ids) - 1) // block_tokens)
        ]
        total += block_tokens * next(
            (k for k, blocks in enumerate(chain) if blocks not in seen), len(chain)
        )
        seen.update(chain)
    return total


def build_workload(
    tokenizer: Any,
    corpus: Any,
    tag: str,
    prefixes: int,
    suffixes: int,
    prefix_tokens: int,
    suffix_tokens: int = 0,
    system_tokens: int = 0,
    *,
    block_tokens: int,
) -> Workload:
    """`suffix_tokens` > 0 puts a context of its own before each question (retrieved passages,
    an agent's tool output), so the shared prefix is only part of the prompt; `system_tokens`
    > 0 opens every prompt with one system prompt shared by all documents (a service's
    instructions and tool schemas)."""

    def text(tokens: int, head: str, seed_tag: str) -> str:
        body = corpus.encode(corpus.document(tokens, seed=zlib.crc32(seed_tag.encode())))
        return str(corpus.decode((corpus.encode(head) + body)[:tokens]))

    system = (
        text(system_tokens, f"System {tag}.\n", f"{tag}-system") + "\n" if system_tokens else ""
    )
    docs = [text(prefix_tokens, f"Document {tag}-{p}.\n", f"{tag}-{p}") for p in range(prefixes)]
    prompts = []
    rng = random.Random(zlib.crc32(tag.encode()))
    half = prefixes // 2
    order = list(range(prefixes))
    for s in range(suffixes):
        # Each round visits every prefix once in a fresh order (a fixed order would let round
        # robin map prefix p to replica p mod 2 and look perfectly affine by accident); halves
        # are shuffled separately so a prefix recurs no sooner than half a round later, after
        # its previous request's prefill.
        order = rng.sample(order[:half], half) + rng.sample(order[half:], prefixes - half)
        for p in order:
            context = (
                corpus.document(suffix_tokens, seed=zlib.crc32(f"{tag}-{p}-{s}".encode())) + "\n"
                if suffix_tokens
                else ""
            )
            prompts.append(
                f"{system}{docs[p]}\n{context}Question {s}: what does document {p} "
                f"say about item {s * 7 + p}?"
            )
    return Workload(
        tuple(prompts), ideal_hit_tokens([tokenizer.encode(p) for p in prompts], block_tokens)
    )


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
        "ttft_p50_ms": round(percentile(ttfts, 50), 2),
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
    `{prefix}_p50_ms` and `{prefix}_p99_ms`.

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
    fake_procs = [start_fake_replica(work_dir) for _ in range(2)]
    servers = start_replicas(model_dir, work_dir, args.engine_blocks)
    rows = []
    try:
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
        for server, _ in servers:
            server.stop()
        for proc, _ in fake_procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
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


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--passthrough":
        _passthrough_main(int(sys.argv[2]), sys.argv[3])
