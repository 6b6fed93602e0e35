"""`kvtier bench chat|trace|rag` (S2, S4, S5): one workload, several fleet configurations,
side by side in one run.

Each configuration gets a fresh fleet (`kvtier.tools.cluster`) and a fresh L2, receives exactly the
same requests with the same timing through its router, and is stopped before the next starts.
Configurations:

    roundrobin-l0          round robin, vLLM prefix cache only (no kvtier)
    kvtier-l1              kvtier L1 (host memory) per replica, round robin
    kvtier-l1l2-roundrobin kvtier L1 + shared L2, round robin
    kvtier-l1l2-prefixaware / kvtier-l1l2-kvaware   L1 + L2 behind kvtier's router

A name may end in `+monitor`: that fleet also runs Prometheus scraping the router and every
replica each second (the monitoring-overhead comparison, docs/observability.md); or in
`+no-l0-events`: its replicas publish no vLLM KV events, so its kvaware router knows their own
caches (L0) only from its decisions and the connector's L1/L2 events (`vllmKvEvents: false`).
While a configuration runs, its router serves the live dashboard (`/dashboard`, URL printed);
the report includes the dashboard's tier-hit time series and, with `--screenshots`, the
dashboard as it stood when the workload ended.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tools.bench.report import (
    Run,
    errors_note,
    markdown_table,
    paired_note,
    plot,
    plot_tier_series,
    repeats_note,
    summarize,
    write_json,
)
from kvtier.tools.bench.scenarios import ChatShape, RagShape, TraceShape
from kvtier.tools.cluster.spec import CacheSpec, FleetSpec, LocalSpec, RoutingSpec
from kvtier.tools.sim.report import prepare_output
from kvtier.tools.sim.trace import BUNDLED_TRACE

CONFIGS: dict[str, tuple[CacheSpec, RoutingSpec]] = {
    "roundrobin-l0": (CacheSpec(l1_enabled=False, l2_enabled=False), RoutingSpec(enabled=False)),
    "kvtier-l1": (CacheSpec(l2_enabled=False), RoutingSpec(enabled=False)),
    "kvtier-l1l2-roundrobin": (CacheSpec(), RoutingSpec(enabled=False)),
    "kvtier-l1l2-prefixaware": (CacheSpec(), RoutingSpec(strategy="prefixaware")),
    "kvtier-l1l2-kvaware": (CacheSpec(), RoutingSpec(strategy="kvaware")),
}
DEFAULT_CONFIGS = "roundrobin-l0,kvtier-l1,kvtier-l1l2-kvaware"


MONITOR = "+monitor"
NO_L0_EVENTS = "+no-l0-events"


def config_spec(base: FleetSpec, name: str, work_dir: Path) -> FleetSpec:
    config = name.removesuffix(MONITOR).removesuffix(NO_L0_EVENTS)
    if config not in CONFIGS:
        raise ConfigError(
            f"--configs: unknown configuration {config!r} (known: {', '.join(CONFIGS)}; "
            f"each may end in {NO_L0_EVENTS} and then {MONITOR})"
        )
    cache, routing = CONFIGS[config]
    local = {"work_dir": str(work_dir / name), "vllm_kv_events": NO_L0_EVENTS not in name}
    return base.model_copy(
        update={
            "cache": cache.model_copy(update={"l1_gib": base.cache.l1_gib}),
            "routing": routing,
            "local": base.local.model_copy(update=local),
        }
    )


def _sessions(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    from kvtier.tools.bench.corpus import Corpus
    from kvtier.tools.bench.scenarios import chat_sessions, rag_sessions, trace_sessions

    corpus = Corpus(tokenizer)
    if args.scenario_name == "S2":
        return chat_sessions(
            corpus,
            ChatShape(
                users=args.users,
                rounds=args.rounds,
                document_tokens=args.document_tokens,
                user_tokens=args.user_tokens,
                think_s=args.think,
            ),
        )
    if args.scenario_name == "S5":
        return rag_sessions(corpus, RagShape(questions=args.questions))
    return trace_sessions(corpus, Path(args.trace), TraceShape(requests=args.requests))


def run_scenario(args: argparse.Namespace) -> list[Run]:
    from transformers import AutoTokenizer

    from kvtier.net.ports import free_port, free_port_range
    from kvtier.tools.bench.workload import Runner
    from kvtier.tools.cluster.local_fleet import LocalFleet

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    base = FleetSpec(
        model=args.model,
        replicas=args.replicas,
        local=LocalSpec(
            engine_kv_cache_blocks=args.engine_blocks,
            router_port=free_port(),
            replica_base_port=args.base_port or free_port_range(args.replicas),
        ),
    )
    # Logs stay under the report directory; each fleet's L2 data is removed after its run.
    work = Path(args.report_dir).resolve() / "fleets"
    runs = []
    for turn in range(args.repeat):
        for name in names:
            label = name if args.repeat == 1 else f"{name}#{turn + 1}"
            spec = config_spec(base, name, work)
            watch = args.dashboard or name.endswith(MONITOR)
            series: tuple[dict[str, Any], ...] = ()
            final: dict[str, Any] = {}
            try:
                with LocalFleet(spec, monitor=name.endswith(MONITOR)) as cluster:
                    if watch:  # the first read starts the router's sampling
                        _dashboard(cluster.url, "/dashboard/data/latest")
                        print(f"{label}: live dashboard at {cluster.url}/dashboard", flush=True)
                    tokenizer = AutoTokenizer.from_pretrained(cluster.model)
                    sessions = _sessions(args, tokenizer)
                    runner = Runner(
                        cluster.url, cluster.model_name, tokenizer, deadline_s=args.deadline
                    )
                    records = asyncio.run(
                        runner.run(sessions, label=f"{args.scenario_name} {label}")
                    )
                    if watch:
                        series, final = _watched(args, cluster.url, label)
            finally:
                shutil.rmtree(spec.work_dir / "l2", ignore_errors=True)
            runs.append(Run(args.scenario_name, label, tuple(records), {}, series, final))
    return runs


def _dashboard(url: str, path: str) -> dict[str, Any]:
    from kvtier.tools.status import fetch

    return fetch(url, path)


def _watched(
    args: argparse.Namespace, url: str, label: str
) -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    """The dashboard's series and totals once the workload is done (after one more sample),
    and its screenshot with `--screenshots`."""
    time.sleep(1.5)
    doc = _dashboard(url, "/dashboard/data")
    if args.screenshots:
        from kvtier.tools.monitoring import capture_dashboard

        png = Path(args.report_dir) / f"{args.scenario_name.lower()}_dashboard_{label}.png"
        capture_dashboard(url + "/dashboard", screenshot=png)
    return tuple(doc["series"]), dict(doc["totals"])


def _cmd(args: argparse.Namespace) -> int:
    prepare_output(Path(args.report_dir), "--report-dir", directory=True)
    if args.json:
        prepare_output(Path(args.json), "--json")
    runs = run_scenario(args)
    rows = [summarize(r) for r in runs]
    _write_results(args, runs, rows)
    report = _write_report(args, runs, rows)
    print(f"\nreport: {report}")
    return 0


def _write_results(args: argparse.Namespace, runs: list[Run], rows: list[dict[str, Any]]) -> None:
    """The measurements: the JSON rows (`--json`) and the dashboard series, written before
    anything is built from them, so that no fault in the report can lose them."""
    if args.json:
        write_json(rows, Path(args.json))
    series = {r.config: r.series for r in runs if r.series}
    if series:
        out = Path(args.report_dir) / f"{args.scenario_name.lower()}_series.json"
        out.write_text(json.dumps(series) + "\n")


def _write_report(args: argparse.Namespace, runs: list[Run], rows: list[dict[str, Any]]) -> Path:
    """The Markdown report and its plots, under `--report-dir`; prints its tables. The p50
    speed-up is against the first configuration of the same repeat."""
    out = Path(args.report_dir)
    images = plot(runs, out, args.scenario_name) + plot_tier_series(runs, out, args.scenario_name)
    baseline = str(rows[0]["config"]).partition("#")[0] if rows else None
    table = markdown_table(rows, baseline=baseline)
    notes = repeats_note(rows) + errors_note(rows) + paired_note(runs)
    shots = sorted(out.glob(f"{args.scenario_name.lower()}_dashboard_*.png"))
    report = out / f"{args.scenario_name.lower()}_report.md"
    report.write_text(
        f"# {args.scenario_name} — {args.help_title}\n\n{table}\n\n"
        + notes
        + _dashboard_note(runs)
        + "\n".join(f"![{p.stem}]({p.name})" for p in [*images, *shots])
        + "\n"
    )
    print(table)
    print(notes, end="")
    return report


def _dashboard_note(runs: list[Run]) -> str:
    """What each watched run's dashboard showed at its end, beside the benchmark's figures."""
    watched = [r for r in runs if r.dashboard]
    if not watched:
        return ""
    lines = [
        "While each configuration ran, its router served the live dashboard at "
        "`<router>/dashboard` (docs/observability.md); its tier-hit series is plotted below. "
        "At the end of each run the dashboard showed:",
        "",
        "| config | requests | TTFT p50 ms | TTFT p90 ms | cached share | routing accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for r in watched:
        d = r.dashboard
        lines.append(
            f"| {r.config} | {d['requests']} | {d['ttft_p50_ms']} | {d['ttft_p90_ms']} | "
            f"{d['cached_share']} | {d['routing_accuracy']} |"
        )
    return "\n".join(lines) + "\n\n"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help=f"comma-separated configurations to compare, in order (default: "
        f"{DEFAULT_CONFIGS}; known: {', '.join(CONFIGS)}; each may end in {NO_L0_EVENTS}: "
        f"no vLLM KV events for the router, and then {MONITOR}: with Prometheus)",
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas per fleet (default 2)")
    p.add_argument("--model", help="local HF model directory (default: the embedded model)")
    p.add_argument(
        "--engine-blocks",
        type=int,
        default=32,
        help="engine (L0) cache size in 128-token blocks per replica, small as on a "
        "small GPU (default 32 = 4,096 tokens)",
    )
    p.add_argument("--base-port", type=int, help="first replica port (default: any free ones)")
    p.add_argument(
        "--deadline",
        type=float,
        default=900.0,
        help="seconds after which a configuration stops sending (default 900)",
    )
    p.add_argument("--json", metavar="FILE", help="write one JSON row per configuration")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the configurations this many times, interleaved (default 1)",
    )
    p.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="do not sample the router dashboard (no tier-hit series; for overhead runs)",
    )
    p.add_argument(
        "--screenshots",
        action="store_true",
        help="screenshot each run's dashboard when its workload ends (needs chromium)",
    )
    p.add_argument(
        "--report-dir",
        default="out/report",
        help="Markdown report and PNG plots go here (default out/report)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    chat = subparsers.add_parser(
        "chat",
        aliases=["s2"],
        help="S2 multi-round chat across fleet configurations",
        description="S2: users share a system prompt, each opens with a document of their "
        "own, then chats for several rounds (growing history, short answers, "
        "Poisson arrivals). Each configuration (--configs) gets a fresh fleet and a fresh L2, "
        "receives exactly the same requests with the same timing through its router, and is "
        "stopped before the next starts.",
    )
    _common(chat)
    shape = ChatShape()
    chat.add_argument(
        "--users", type=int, default=shape.users, help="concurrent chat users (default %(default)s)"
    )
    chat.add_argument(
        "--rounds", type=int, default=shape.rounds, help="rounds per user (default %(default)s)"
    )
    chat.add_argument(
        "--document-tokens",
        type=int,
        default=shape.document_tokens,
        help="tokens of each user's own document, sent in round 1 (default %(default)s; 0: none)",
    )
    chat.add_argument(
        "--user-tokens",
        type=int,
        default=shape.user_tokens,
        help="tokens of each round's user message (default %(default)s)",
    )
    chat.add_argument(
        "--think",
        type=float,
        default=shape.think_s,
        help="seconds a user waits after an answer (default %(default)s)",
    )
    chat.set_defaults(func=_cmd, scenario_name="S2", help_title="multi-round chat")
    trace = subparsers.add_parser(
        "trace",
        aliases=["s4"],
        help="S4 Mooncake trace replay across fleet configurations",
        description="S4: replays the first requests of a Mooncake-format trace with its prefix "
        "structure (each 512-token trace block becomes 128 real tokens, at most 8 "
        "per prompt, half speed).",
    )
    _common(trace)
    trace.add_argument(
        "--trace",
        default=str(BUNDLED_TRACE),
        help="Mooncake JSONL trace, gzipped if its name ends in .gz (default: the bundled "
        "Mooncake conversation trace)",
    )
    trace.add_argument(
        "--requests",
        type=int,
        default=120,
        help="replay the trace's first N requests (default %(default)s)",
    )
    trace.set_defaults(func=_cmd, scenario_name="S4", help_title="trace replay")
    rag = subparsers.add_parser(
        "rag",
        aliases=["s5"],
        help="S5 RAG: long documents, many questions",
        description="S5: a few 1,500-token documents, each asked many short questions.",
    )
    _common(rag)
    rag.add_argument(
        "--questions",
        type=int,
        default=24,
        help="questions in all, each on a document drawn at random (default %(default)s)",
    )
    rag.set_defaults(func=_cmd, scenario_name="S5", help_title="RAG")
