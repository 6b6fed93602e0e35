"""`kvtier bench chaos`: faults under load, one at a time, with what the clients saw.

A fleet of 3 replicas behind the router under steady, bounded load (chat and completions,
streaming and not, shared prefixes, greedy); each fault injected, held, recovered, and
measured (`kvtier.tools.chaos.run`): requests sent, succeeded, failed (streaming or not,
started before or after the fault), answers that differ from the fault-free reference, time
until serving is normal again, L2 blocks lost beyond the failed part, leaked processes and
mounts. `--soak SECONDS` runs one fleet that long instead, a fault every `--soak-interval`,
sampling memory and open files of router and replicas. Needs root (mounts), FUSE and the
embedded model; results go to `--report-dir` (chaos_report.md, chaos.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtier.core.errors import ConfigError

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from kvtier.tools.chaos.faults import FAULTS
    from kvtier.tools.chaos.fleet import FleetOptions
    from kvtier.tools.chaos.run import Timing, as_json, result_rows, run_phase, soak

    names = [n.strip() for n in args.faults.split(",") if n.strip()] if args.faults else [*FAULTS]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ConfigError(f"--faults: unknown {unknown} (known: {', '.join(FAULTS)})")
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = FleetOptions(
        model=args.model,
        replicas=args.replicas,
        connector=(("load_async", True),) if args.load_async else (),
    )
    timing = Timing(5.0, 10.0) if args.quick else Timing(pre_s=args.pre, post_s=args.post)
    if args.soak:
        faults = [FAULTS[n] for n in names if FAULTS[n].phase == "juicefs" and n != "control"]
        report = soak(out / "work", options, faults, args.soak, args.soak_interval, timing)
        (out / "soak.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report["growth"], indent=2))
        print(f"\nreport: {out / 'soak.json'}")
        return 0
    results, phases = [], []
    for phase in ("juicefs", "faultfs", "valkey"):
        chosen = [FAULTS[n] for n in names if FAULTS[n].phase == phase]
        if chosen:
            got, info = run_phase(phase, chosen, out / "work", options, timing)
            results += got
            phases.append(info)
    table = result_rows(results)
    (out / "chaos.json").write_text(json.dumps(as_json(results, phases), indent=2))
    (out / "chaos_report.md").write_text(f"# kvtier bench chaos\n\n{table}\n")
    print(table)
    print(json.dumps(phases, indent=2))
    print(f"\nreport: {out / 'chaos_report.md'}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "chaos",
        help="inject faults into a 3-replica fleet under load and report what clients saw",
        description="Faults one at a time under steady load through the router (replica "
        "SIGKILL/SIGSTOP/restart, router kill, L2 unmount/EIO/slow/full/corrupt, Valkey and "
        "JuiceFS metadata kills): failures as clients saw them, wrong outputs, recovery time, "
        "L2 blocks lost, leaked processes and mounts. Needs root and FUSE.",
        epilog="docs/reliability.md has the tables of a run and the soak command.",
    )
    p.add_argument("--faults", help="comma-separated faults (default: all)")
    p.add_argument("--quick", action="store_true", help="shorter load windows (CI)")
    p.add_argument("--pre", type=float, default=8.0, help="seconds of load before a fault")
    p.add_argument("--post", type=float, default=15.0, help="seconds of load after its end")
    p.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    p.add_argument("--model", help="local HF model directory (default: the embedded model)")
    p.add_argument(
        "--load-async",
        action="store_true",
        help="replicas load L2 blocks asynchronously (connector load_async)",
    )
    p.add_argument("--soak", type=float, help="soak for this many seconds instead")
    p.add_argument("--soak-interval", type=float, default=180.0, help="seconds between soak faults")
    p.add_argument("--report-dir", default="reports/chaos", help="where results go")
    p.set_defaults(func=_run)
