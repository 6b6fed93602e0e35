"""What monitoring costs a running fleet: CPU per scrape of each target, and TTFT with
Prometheus scraping against the same fleet with it paused, side by side.

    kvtier up --monitor &            # wait for the endpoint, then:
    python -m kvtier.tools.bench.monitoring_cost --scrapes 300 --rounds 30

Reads the fleet from `.kvtier/cluster/cluster.json` (`--state`).

CPU: for each target (the router, every replica), the CPU time of the process listening on its
port, with its children, over `--scrapes` back-to-back GETs of `/metrics`, less that process's
idle rate over the same time, per scrape; and Prometheus's own CPU over `--idle` seconds.

TTFT: `--rounds` rounds; in each, Prometheus runs (SIGCONT) and is paused (SIGSTOP), in an
order that alternates, and in each state, after 3 s, one streamed completion of a fresh
`--tokens`-token document (cold) and the same document again (a hit). The paired ratio of a
round is TTFT with monitoring over TTFT without, per kind; the median of the rounds' ratios
and its quartiles are printed. Prometheus is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from kvtier.tools.bench.client import new_pool, stream_request
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.embedded_model import default_model_dir


def listener(url: str) -> psutil.Process:
    """The process listening on `url`'s port."""
    port = urllib.parse.urlsplit(url).port
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid)
    raise SystemExit(f"no process listens on {url}")


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU of `proc` and its live children."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def scrape_cost(url: str, idle_s: float, scrapes: int) -> str:
    proc = listener(url)
    before, start = cpu_seconds(proc), time.monotonic()
    time.sleep(idle_s)
    idle_rate = (cpu_seconds(proc) - before) / (time.monotonic() - start)
    sizes = []
    before, start = cpu_seconds(proc), time.monotonic()
    for _ in range(scrapes):
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            sizes.append(len(resp.read()))
    elapsed = time.monotonic() - start
    cpu_ms = 1000 * (cpu_seconds(proc) - before - idle_rate * elapsed) / scrapes
    return (
        f"{url}: {cpu_ms:.2f} ms CPU per scrape ({cpu_ms / 10:.2f}% of a core at 1 scrape/s), "
        f"{1000 * elapsed / scrapes:.2f} ms wall, {statistics.median(sizes) / 1024:.0f} KiB, "
        f"idle {idle_rate:.1%} of a core"
    )


def quartiles(values: list[float]) -> str:
    """The median of at least one value and, of two or more, the quartiles."""
    median = f"median {statistics.median(values):.3f}"
    if len(values) < 2:
        return f"{median}, no quartiles of one round"
    q = statistics.quantiles(values, n=4)
    return f"{median}, quartiles {q[0]:.3f}-{q[2]:.3f}"


async def ttft_rounds(
    state: dict[str, Any], prometheus: psutil.Process, rounds: int, tokens: int
) -> None:
    from transformers import AutoTokenizer

    router = state["router"]
    with urllib.request.urlopen(router + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]
    corpus = Corpus(AutoTokenizer.from_pretrained(model.get("root") or default_model_dir()))
    pool = new_pool(300.0)
    ratios: dict[str, list[float]] = {"cold": [], "hit": []}
    try:
        for r in range(rounds):
            ttft: dict[tuple[bool, str], float] = {}
            for monitored in (True, False) if r % 2 == 0 else (False, True):
                prometheus.send_signal(signal.SIGCONT if monitored else signal.SIGSTOP)
                await asyncio.sleep(3.0)
                body = {
                    "model": model["id"],
                    "prompt": corpus.document(tokens, seed=os.getpid() * 1000 + 2 * r + monitored),
                    "max_tokens": 1,
                    "temperature": 0.0,
                }
                for kind in ("cold", "hit"):
                    ttft[monitored, kind] = (await stream_request(pool, router, body)).ttft_ms
            for kind in ratios:
                ratios[kind].append(ttft[True, kind] / ttft[False, kind])
            print(
                f"round {r + 1}/{rounds}: "
                + ", ".join(f"{k} {ttft[True, k]:.0f}/{ttft[False, k]:.0f} ms" for k in ratios),
                flush=True,
            )
    finally:
        prometheus.send_signal(signal.SIGCONT)
        pool.close()
    for kind, values in ratios.items():
        print(f"TTFT {kind}, monitored / paused, {len(values)} rounds: {quartiles(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path(".kvtier/cluster/cluster.json"))
    parser.add_argument("--idle", type=float, default=30.0, help="idle window per target, s")
    parser.add_argument("--scrapes", type=int, default=300, help="GETs of /metrics per target")
    parser.add_argument("--rounds", type=int, default=30, help="TTFT rounds (0: none)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of each document")
    args = parser.parse_args()
    if args.rounds < 0:
        parser.error("--rounds: must be 0 or more")
    state = json.loads(args.state.read_text())
    if not state.get("prometheus"):
        raise SystemExit("the fleet runs without Prometheus: start it with `kvtier up --monitor`")
    prometheus = listener(state["prometheus"])
    before = cpu_seconds(prometheus)
    time.sleep(args.idle)
    print(f"prometheus: {(cpu_seconds(prometheus) - before) / args.idle:.2%} of one core")
    for url in [state["router"], *state["replicas"]]:
        print(scrape_cost(url, args.idle, args.scrapes), flush=True)
    if args.rounds:
        asyncio.run(ttft_rounds(state, prometheus, args.rounds, args.tokens))


if __name__ == "__main__":
    main()
