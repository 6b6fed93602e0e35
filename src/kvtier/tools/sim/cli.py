"""`kvtier sim` and `kvtier plan`: flags into a `FleetConfig` and a `CostModel`, no logic here."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.tools.sim.caches import EVICTION
from kvtier.tools.sim.cost_model import CostModel, load_costs
from kvtier.tools.sim.report import prepare_output, write_output
from kvtier.tools.sim.routing import parse_option, strategy_names
from kvtier.tools.sim.simulator import FleetConfig
from kvtier.tools.sim.sweep import SWEEPABLE, parse_capacity
from kvtier.tools.sim.trace import BUNDLED_TRACE, Trace, load_trace

__all__ = ["register"]

_TRACE_HELP = (
    "request trace in the Mooncake JSONL format (timestamp ms, input_length, "
    "output_length, hash_ids of 512-token blocks), gzipped if its name ends in .gz "
    "(default: the bundled Mooncake conversation trace, 12,031 requests)"
)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kvtier.tools.sim import agent_trace

    sim = subparsers.add_parser(
        "sim",
        help="simulate a fleet replaying a trace (hit rates, TTFT, load balance)",
        description="Replay a request trace through a discrete-event model of N replicas "
        "(L0 engine cache and L1 host memory each, a shared L2 pool), routed by "
        "the router's own strategies. Capacities are in trace blocks; 'inf' is "
        "unbounded. Prints hit rate per tier, TTFT percentiles and load balance.",
        epilog="examples:\n"
        "  kvtier sim --trace T.jsonl --replicas 16 --strategy kvaware --json out.json\n"
        "  kvtier sim --trace T.jsonl --replicas 1 --l0-blocks 1000 --l1-blocks 0 "
        "--l2-blocks 0 --sweep l0=0,100,1000,10000,inf --json lru.json\n"
        "  kvtier sim --trace T.jsonl --sweep replicas=4,8,16,32 "
        "--sweep strategy=kvaware,roundrobin --json replicas.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_fleet_arguments(sim)
    sim.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help=f"rerun over these values of one parameter ({', '.join(SWEEPABLE)}); "
        "a second --sweep draws one series per value",
    )
    sim.add_argument(
        "--json", type=Path, metavar="FILE", help="write the result (or the sweep's points) as JSON"
    )
    sim.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="PNG of a sweep, with --sweep only (default: the --json path with .png)",
    )
    sim.set_defaults(func=_run_sim)

    plan = subparsers.add_parser(
        "plan",
        help="find the tier capacity a trace needs for a target hit rate",
        description="Answer 'how much L1 (or L2, or L0) do I need for this hit rate on this "
        "trace': bisection over the capacity of one tier, every probe a full "
        "simulation with the other tiers as given. Prints blocks and GiB (KV bytes "
        "per token of the cost profile).",
        epilog="example:\n"
        "  kvtier plan --trace T.jsonl --target-hit-rate 0.3 --tier l1 --replicas 1 "
        "--l0-blocks 0 --l2-blocks 0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_fleet_arguments(plan)
    plan.add_argument(
        "--target-hit-rate",
        type=float,
        required=True,
        metavar="F",
        help="block hit rate to reach, e.g. 0.3",
    )
    plan.add_argument(
        "--tier",
        choices=[t.value for t in Tier],
        default=Tier.L1.value,
        help="tier to size (default l1: per replica; l2 is the shared pool)",
    )
    plan.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        metavar="F",
        help="stop when the answer is known within this fraction (default 0.02)",
    )
    plan.add_argument("--json", type=Path, metavar="FILE", help="write the answer as JSON")
    plan.set_defaults(func=_run_plan)
    agent_trace.register(subparsers)


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", type=Path, default=BUNDLED_TRACE, metavar="FILE", help=_TRACE_HELP
    )
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply arrival times (2 halves the request rate; default 1)",
    )
    parser.add_argument(
        "--replicas", type=int, default=16, metavar="N", help="replicas in the fleet (default 16)"
    )
    parser.add_argument(
        "--strategy",
        choices=strategy_names(),
        default="kvaware",
        help="routing strategy of kvtier.router.policies (default kvaware)",
    )
    parser.add_argument(
        "--policy-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy option, e.g. queue_weight=0.5 or running_penalty=256 "
        "(CostWeights fields) or speculative_ttl_s=5; repeatable",
    )
    for tier, what in (
        ("l0", "engine (GPU) cache per replica"),
        ("l1", "host-memory tier per replica"),
        ("l2", "shared pool"),
    ):
        parser.add_argument(
            f"--{tier}-blocks",
            type=_capacity,
            metavar="N|inf",
            help=f"{what} in trace blocks (default: the cost profile's {tier}_gib; 0 disables)",
        )
        parser.add_argument(
            f"--{tier}-eviction",
            choices=sorted(EVICTION),
            default="lru",
            help=f"eviction policy of {tier} (default lru; janitor: as kvtier's L2 janitor "
            "keeps a shared directory, recency from writes and throttled L2 reads)",
        )
    parser.add_argument(
        "--costs",
        metavar="PROFILE|FILE",
        help="cost profile of kvtier/tools/sim/costs.json (cpu-smollm2, gpu-7b; "
        "default gpu-7b) or a JSON file of the same shape",
    )
    parser.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one cost field, e.g. prefill_tokens_per_s=5000",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the routing tie-breaks")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _capacity(text: str) -> float:
    try:
        return parse_capacity(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _costs(args: argparse.Namespace) -> CostModel:
    overrides: dict[str, float] = {}
    for item in args.cost:
        key, _, value = item.partition("=")
        try:
            overrides[key] = float(value)
        except ValueError:
            raise ConfigError(f"cost: expected KEY=NUMBER, got {item!r}") from None
    return load_costs(args.costs, overrides)


def _inputs(args: argparse.Namespace) -> tuple[Trace, FleetConfig, CostModel]:
    costs = _costs(args)
    trace = load_trace(args.trace, limit=args.limit, time_scale=args.time_scale)
    capacity = {}
    for tier in Tier:
        given = getattr(args, f"{tier.value}_blocks")
        capacity[tier] = (
            given if given is not None else float(costs.default_blocks(tier, trace.block_tokens))
        )
    config = FleetConfig(
        replicas=args.replicas,
        l0_blocks=capacity[Tier.L0],
        l1_blocks=capacity[Tier.L1],
        l2_blocks=capacity[Tier.L2],
        l0_eviction=args.l0_eviction,
        l1_eviction=args.l1_eviction,
        l2_eviction=args.l2_eviction,
        strategy=args.strategy,
        strategy_options=dict(parse_option(o) for o in args.policy_opt),
        seed=args.seed,
    )
    return trace, config, costs


def _progress(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def _write_json(path: Path | None, doc: object) -> None:
    if path is not None:
        write_output(path, json.dumps(doc, indent=1) + "\n")


def _run_sim(args: argparse.Namespace) -> int:
    from kvtier.tools.sim.plot import plot_sweep
    from kvtier.tools.sim.simulator import simulate
    from kvtier.tools.sim.sweep import parse_sweep, run_sweep

    if args.plot is not None and not args.sweep:
        raise ConfigError(
            "--plot: draws the curves of a sweep; add --sweep NAME=V1,V2,... "
            "(a single run has no curve: --json holds its numbers)"
        )
    png = args.plot or (args.json.with_suffix(".png") if args.json and args.sweep else None)
    if png is not None and not png.suffix:
        png = png.with_suffix(".png")  # what matplotlib writes: say so
    for path, flag in ((args.json, "--json"), (png, "--plot")):
        if path is not None:
            prepare_output(path, flag)
    trace, config, costs = _inputs(args)
    if not args.sweep:
        result = simulate(trace, config, costs, progress=_progress(args))
        print(result.summary())
        _write_json(args.json, result.to_dict())
        return 0
    axes = [parse_sweep(s) for s in args.sweep]

    def show(point: dict[str, Any]) -> None:
        series = f"{axes[1].name}={point['series']}  " if len(axes) == 2 else ""
        print(
            f"{series}{axes[0].name}={point['x']}: hit {point['hit_rate']:.1%}  "
            f"TTFT p50 {point['ttft_p50_ms']:.0f} ms p99 {point['ttft_p99_ms']:.0f} ms  "
            f"load max/mean {point['load_max_over_mean']:.2f}  ({point['wall_s']:.1f} s)",
            flush=True,
        )

    doc = run_sweep(trace, config, costs, axes, progress=_progress(args), on_point=show)
    doc["base"] = {**config.describe(), "trace": str(args.trace), "requests": len(trace)}
    _write_json(args.json, doc)
    if png is not None:
        strategy = "" if "strategy" in {a.name for a in axes} else f", {config.strategy}"
        plot_sweep(doc, png, title=f"{args.trace.name}: {len(trace)} requests{strategy}")
        print(f"plot: {png}")
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from kvtier.tools.sim.plan import plan_capacity

    if args.json is not None:
        prepare_output(args.json, "--json")
    trace, config, costs = _inputs(args)
    tier = Tier(args.tier)

    def show(blocks: object, rate: float) -> None:
        if not args.quiet:
            print(f"  {tier.value}={blocks}: hit {rate:.2%}", file=sys.stderr, flush=True)

    answer = plan_capacity(
        trace, config, costs, tier, args.target_hit_rate, tolerance=args.tolerance, on_probe=show
    )
    print(answer.summary())
    _write_json(
        args.json,
        {
            **asdict(answer),
            "config": {**config.describe(), "trace": str(args.trace), "requests": len(trace)},
        },
    )
    return 0 if answer.reachable else 1
