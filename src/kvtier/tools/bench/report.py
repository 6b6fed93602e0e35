"""Summaries, Markdown tables, JSON rows and PNG plots of benchmark records.

One row per (scenario, configuration), all measured in one run:
- `ttft_p50_ms`, `ttft_p90_ms`, `ttft_p99_ms` — time to first token of successful requests;
- `cached_token_share` — prompt tokens served from any cache tier / all prompt tokens;
- `reusable_token_share_served` — of the tokens an earlier request had already sent (what a
  perfect fleet-wide cache could serve), the share that was served from cache;
- `throughput_rps`, `prompt_tokens_per_s` over the span of the run.

`paired_note` compares configurations request by request: every configuration receives the same
requests, so the TTFT of one (session, round) under a configuration over its TTFT under the
first configuration of the same repeat is one paired ratio; their median cancels the spread of
prompt lengths that makes p50s of whole runs noisy.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tools.bench.workload import Record


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


@dataclass(frozen=True, slots=True)
class Run:
    scenario: str
    config: str
    records: tuple[Record, ...]
    extra: Mapping[str, Any]
    """Figures the run adds to its row (e.g. per-tier hit tokens from the replicas)."""
    series: tuple[Mapping[str, Any], ...] = ()
    """The router dashboard's time series of the run (`kvtier.router.dashboard`), if watched."""
    dashboard: Mapping[str, Any] = field(default_factory=dict)
    """The dashboard's totals at the end of the run (what its screenshot shows)."""


def summarize(run: Run) -> dict[str, Any]:
    ok = [r for r in run.records if r.error is None]
    ttft = [r.ttft_ms for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    reusable = sum(r.reusable_tokens for r in ok)
    served = sum(min(r.cached_tokens, r.reusable_tokens) for r in ok)
    span = max((r.start_s + r.total_ms / 1000 for r in ok), default=0.0) - min(
        (r.start_s for r in ok), default=0.0
    )
    row: dict[str, Any] = {
        "scenario": run.scenario,
        "config": run.config,
        "ttft_p50_ms": round(statistics.median(ttft), 1) if ttft else None,
        "ttft_p90_ms": round(percentile(ttft, 90), 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99), 1) if ttft else None,
        "cached_token_share": round(cached / prompt, 4) if prompt else 0.0,
        "reusable_token_share_served": round(served / reusable, 4) if reusable else 0.0,
        "requests": len(ok),
        "errors": len(run.records) - len(ok),
        "errors_seen": sorted({r.error for r in run.records if r.error is not None})[:3],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reusable_tokens": reusable,
        "throughput_rps": round(len(ok) / span, 3) if span > 0 else None,
        "prompt_tokens_per_s": round(prompt / span, 1) if span > 0 else None,
    }
    row.update(run.extra)
    return row


def ttft_by_round(run: Run) -> dict[int, float]:
    rounds: dict[int, list[float]] = defaultdict(list)
    for r in run.records:
        if r.error is None:
            rounds[r.round].append(r.ttft_ms)
    return {k: statistics.median(v) for k, v in sorted(rounds.items())}


_COLUMNS = (
    ("config", "config"),
    ("requests", "req"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p90_ms", "p90"),
    ("ttft_p99_ms", "p99"),
    ("throughput_rps", "req/s"),
    ("cached_token_share", "cached share"),
    ("reusable_token_share_served", "reusable served"),
    ("errors", "errors"),
)


def markdown_table(rows: Sequence[Mapping[str, Any]], baseline: str | None = None) -> str:
    """A table of rows, "-" for a figure that is None (no successful request); with
    `baseline` (a configuration name without its `#k`), a column of p50 speed-up against that
    configuration in the same repeat (labels `name#k` with `--repeat`)."""
    head = [title for _, title in _COLUMNS] + (["p50 speed-up"] if baseline else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    bases = _baseline_p50s(rows, baseline) if baseline else {}
    for row in rows:
        cells = [_cell(row.get(key, "")) for key, _ in _COLUMNS]
        if baseline:
            base = bases.get(str(row["config"]).partition("#")[2])
            p50 = row.get("ttft_p50_ms")
            cells.append(f"{base / p50:.2f}x" if base and p50 else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _baseline_p50s(rows: Sequence[Mapping[str, Any]], baseline: str) -> dict[str, float]:
    """Per repeat (the `k` of a label `name#k`; "" without `--repeat`), the TTFT p50 of
    configuration `baseline` in that repeat."""
    p50s: dict[str, float] = {}
    for row in rows:
        name, _, repeat = str(row["config"]).partition("#")
        if name == baseline and row.get("ttft_p50_ms"):
            p50s[repeat] = row["ttft_p50_ms"]
    return p50s


def paired_ratios(run: Run, base: Run) -> list[float]:
    """TTFT of each request `run` answered over the TTFT `base` had for the same request."""
    ttft = {(r.session, r.round): r.ttft_ms for r in base.records if r.error is None}
    return [
        r.ttft_ms / ttft[r.session, r.round]
        for r in run.records
        if r.error is None and ttft.get((r.session, r.round), 0.0) > 0
    ]


def paired_note(runs: Sequence[Run]) -> str:
    """Per configuration, the median and quartiles of its paired TTFT ratios against the first
    configuration of each repeat (labels `name#k`), pooled over the repeats."""
    turns: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        turns[r.config.partition("#")[2]].append(r)
    pooled: dict[str, list[float]] = defaultdict(list)
    for turn in turns.values():
        for r in turn[1:]:
            pooled[r.config.partition("#")[0]] += paired_ratios(r, turn[0])
    if not pooled:
        return ""
    base = runs[0].config.partition("#")[0]
    lines = [
        f"Paired TTFT (each request against the same request under {base}, same repeat):",
        "",
        "| config | paired requests | median ratio | quartiles |",
        "|---|---|---|---|",
    ]
    for name, ratios in pooled.items():
        lines.append(f"| {name} | {len(ratios)} | {_ratio_quartiles(ratios)} |")
    return "\n".join(lines) + "\n\n"


def _ratio_quartiles(ratios: list[float]) -> str:
    """Median and quartiles as two table cells: "median | q1-q3"; "-" for no ratios (a
    configuration with no request that succeeded under it and under the baseline)."""
    if not ratios:
        return "- | -"
    q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{q2:.3f} | {q1:.3f}-{q3:.3f}"


def repeats_note(rows: Sequence[Mapping[str, Any]]) -> str:
    """With `--repeat` (labels `name#k`): per configuration, the median and min-max over the
    repeats of its TTFT p50, of its p50 speed-up against the first configuration of the same
    repeat, and of the reusable tokens it served. Empty for a single run."""
    turns: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for row in rows:
        name, _, repeat = str(row["config"]).partition("#")
        if not repeat:
            return ""
        turns[repeat][name] = row
    by_config: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for turn in turns.values():
        base = next(iter(turn.values())).get("ttft_p50_ms")
        for name, row in turn.items():
            figures = by_config[name]
            if row.get("ttft_p50_ms"):
                figures["p50"].append(row["ttft_p50_ms"])
                if base:
                    figures["speed-up"].append(base / row["ttft_p50_ms"])
            figures["served"].append(row.get("reusable_token_share_served", 0.0))
    lines = [
        f"Over {len(turns)} repeats: median (min-max) of each repeat's figure:",
        "",
        "| config | TTFT p50 ms | p50 speed-up | reusable served |",
        "|---|---|---|---|",
    ]
    for name, figures in by_config.items():
        lines.append(
            f"| {name} | {_spread(figures['p50'], '{:.1f}')} "
            f"| {_spread(figures['speed-up'], '{:.2f}x')} "
            f"| {_spread(figures['served'], '{:.3f}')} |"
        )
    return "\n".join(lines) + "\n\n"


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(low)}-{fmt.format(high)})"


def errors_note(rows: Sequence[Mapping[str, Any]]) -> str:
    """The first distinct error texts of each configuration that had failed requests."""
    lines = [
        f"- {row['config']}: {row['errors']} failed; " + "; ".join(map(str, row["errors_seen"]))
        for row in rows
        if row.get("errors")
    ]
    return "Failed requests:\n\n" + "\n".join(lines) + "\n\n" if lines else ""


def plot(runs: Sequence[Run], out_dir: Path, scenario: str) -> list[Path]:
    """PNG plots: TTFT per configuration, TTFT by round (chat), cached share per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    mine = [r for r in runs if r.scenario == scenario]

    def figure(name: str, title: str, ylabel: str, draw: Any) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{scenario}: {title}")
        fig.tight_layout()
        paths.append(out_dir / f"{scenario.lower()}_{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    def by_round(ax: Any) -> None:
        for r in mine:
            medians = ttft_by_round(r)
            ax.plot([k + 1 for k in medians], list(medians.values()), marker="o", label=r.config)
        ax.set_xlabel("round")
        ax.legend()

    rows = [summarize(r) for r in mine]
    figure(
        "ttft",
        "time to first token per configuration",
        "TTFT (ms)",
        lambda ax: ax.boxplot(
            [[x.ttft_ms for x in r.records if x.error is None] or [0] for r in mine],
            tick_labels=[r.config for r in mine],
            showfliers=False,
        ),
    )
    if any(len(ttft_by_round(r)) > 1 for r in mine):
        figure("ttft_by_round", "TTFT by round", "median TTFT (ms)", by_round)
    figure(
        "hit_share",
        "cache hit share",
        "prompt tokens served from cache",
        lambda ax: (
            ax.bar([r["config"] for r in rows], [r["cached_token_share"] for r in rows]),
            ax.set_ylim(0, 1),
        ),
    )
    return paths


TIER_COLORS = {"l0": "#2e7d32", "l1": "#1e88e5", "l2": "#8e24aa", "computed": "#bdbdbd"}


def plot_tier_series(runs: Sequence[Run], out_dir: Path, scenario: str) -> list[Path]:
    """One PNG: prompt tokens/s served by each tier over the run, per configuration (from the
    router dashboard's series; nothing when no run was watched)."""
    watched = [r for r in runs if r.scenario == scenario and r.series]
    if not watched:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(watched), 1, figsize=(8, 2.4 * len(watched)), squeeze=False)
    for ax, run in zip(axes[:, 0], watched, strict=True):
        points = [p for p in run.series if "tokens_per_s" in p]
        t0 = points[0]["t"] if points else 0.0
        ax.stackplot(
            [p["t"] - t0 for p in points],
            *([p["tokens_per_s"][tier] for p in points] for tier in TIER_COLORS),
            labels=[tier.upper() for tier in TIER_COLORS],
            colors=list(TIER_COLORS.values()),
        )
        ax.set_title(run.config, fontsize=9)
        ax.set_ylabel("tokens/s")
    axes[0, 0].legend(loc="upper right", fontsize=8, ncols=4)
    axes[-1, 0].set_xlabel("seconds into the run")
    fig.suptitle(f"{scenario}: prompt tokens served by tier (router dashboard, 1 s samples)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{scenario.lower()}_tier_series.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def write_json(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """`rows` as strict JSON: a float that is NaN or infinite (a figure of no values) is null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(list(rows)), indent=2, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    """`value` with every non-finite float in it, however deeply nested, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
