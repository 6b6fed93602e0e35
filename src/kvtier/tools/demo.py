"""`kvtier demo`: the main job in a few minutes on 2 cores.

It runs two benchmarks through their own commands, so the demo shows exactly what they
measure: S2 multi-round chat on a 2-replica fleet (round robin with vLLM's prefix cache only,
against kvtier L1+L2 behind the kvaware router), then S1 (TTFT cold / L0 / L1 / L2 on another
replica). It prints both comparison tables and the path of the report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

S1_SCENARIOS = ("cold", "l0", "l1", "l2_cross")


def s1_table(rows: list[dict[str, object]]) -> str:
    """Median TTFT per prompt length and tier for kvtier, with cold/hit ratios."""
    kvtier = {
        (r["tokens"], r["scenario"]): r.get("ttft_ms") for r in rows if r.get("system") == "kvtier"
    }
    lines = [
        "| tokens | cold ms | L0 ms | L1 ms | L2 (other replica) ms | cold / L2 |",
        "|---|---|---|---|---|---|",
    ]
    for tokens in sorted({t for t, _ in kvtier}, key=lambda t: int(str(t))):
        cells = [kvtier.get((tokens, s)) for s in S1_SCENARIOS]
        cold, l2 = cells[0], cells[3]
        ratio = f"{float(str(cold)) / float(str(l2)):.1f}x" if cold and l2 else ""
        lines.append(
            f"| {tokens} | "
            + " | ".join(f"{float(str(c)):.0f}" if c is not None else "" for c in cells)
            + f" | {ratio} |"
        )
    return "\n".join(lines)


def _bench(argv: list[str]) -> int:
    """Run `kvtier bench ARGV...` (chat or tiers) through the benchmark's own command."""
    from kvtier.tools.bench import fleet_runs, tiers

    parser = argparse.ArgumentParser(prog="kvtier bench")
    scenarios = parser.add_subparsers(dest="scenario", required=True)
    fleet_runs.register(scenarios)
    tiers.register(scenarios)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _cmd(args: argparse.Namespace) -> int:
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    print("kvtier demo 1/2: S2 multi-round chat on a 2-replica fleet", flush=True)
    code = _bench(
        [
            "chat",
            "--users",
            "3",
            "--rounds",
            "3",
            "--configs",
            "roundrobin-l0,kvtier-l1l2-kvaware",
            "--report-dir",
            str(out),
            "--json",
            str(out / "s2.json"),
        ]
    )
    if code:
        return code
    print("\nkvtier demo 2/2: S1 time to first token by tier", flush=True)
    code = _bench(
        [
            "tiers",
            "--lengths",
            "1024,2500",
            "--runs",
            "1",
            "--skip-peers",
            "--json",
            str(out / "s1.json"),
        ]
    )
    if code:
        return code
    table = s1_table(json.loads((out / "s1.json").read_text()))
    with open(out / "s2_report.md", "a") as report:
        report.write(f"\n# S1 — TTFT by tier\n\n{table}\n")
    print(f"\n{table}\n\nreport: {out / 's2_report.md'} (JSON: {out}/s2.json, {out}/s1.json)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "demo",
        help="a few-minute demo: S2 chat on a 2-replica fleet, then S1 tiers",
        description=__doc__,
    )
    p.add_argument(
        "--report-dir",
        default="out/demo",
        help="report, plots and JSON go here (default: %(default)s)",
    )
    p.set_defaults(func=_cmd)
