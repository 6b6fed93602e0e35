"""`kvtier bench tiers-chart`: the breakdown of cache hits from two `kvtier bench tiers` runs,
before and after a change, in one chart.

    kvtier bench tiers-chart --before old.json --after new.json --chart hits.png \\
        --systems kvtier,kvtier-juicefs

Reads the breakdown rows (`--breakdown`) of both JSON files and draws them as one stacked bar
each, the two runs' bars of a system and length side by side ("(before)", "(after)"), with the
phases of `kvtier.tools.bench.tiers_breakdown`. Only pairs present in both runs are drawn, so
the chart never shows a bar without its counterpart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError
from kvtier.tools.bench.tiers_breakdown import write_chart

__all__ = ["paired_breakdowns", "register"]


def _breakdowns(path: str) -> dict[tuple[int, str], dict[str, Any]]:
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KvtierError(f"{path}: not a readable `kvtier bench tiers` JSON file: {exc}") from exc
    found = {
        (int(r["tokens"]), str(r["breakdown"])): r
        for r in rows
        if isinstance(r, dict) and "breakdown" in r
    }
    if not found:
        raise KvtierError(f"{path}: no breakdown rows (run `kvtier bench tiers --breakdown`)")
    return found


def paired_breakdowns(
    before: str, after: str, systems: set[str] | None = None
) -> list[dict[str, Any]]:
    """Breakdown rows of both runs for every (length, system) the two have in common (and in
    `systems`, when given), labelled "(before)" and "(after)", ordered by length and system."""
    old, new = _breakdowns(before), _breakdowns(after)
    keys = sorted(k for k in old.keys() & new.keys() if systems is None or k[1] in systems)
    if not keys:
        raise KvtierError(f"{before} and {after}: no system and length in common to compare")
    return [
        {**run[key], "breakdown": f"{key[1]} ({label})"}
        for key in keys
        for label, run in (("before", old), ("after", new))
    ]


def _run(args: argparse.Namespace) -> int:
    systems = set(args.systems.split(",")) if args.systems else None
    rows = paired_breakdowns(args.before, args.after, systems)
    write_chart(rows, Path(args.chart), title=args.title)
    print(f"kvtier bench tiers-chart: {len(rows)} bars -> {args.chart}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "tiers-chart",
        help="chart the L2-hit breakdowns of two `bench tiers` runs, before and after",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--before", required=True, help="JSON of the earlier `bench tiers` run")
    p.add_argument("--after", required=True, help="JSON of the later run")
    p.add_argument("--chart", required=True, help="PNG to write")
    p.add_argument(
        "--systems",
        help="comma-separated systems to draw, e.g. kvtier,kvtier-juicefs (default: all "
        "the runs have in common)",
    )
    p.add_argument(
        "--title",
        default="Where an L2 hit's time goes, before and after",
        help="chart title",
    )
    p.set_defaults(func=_run)
