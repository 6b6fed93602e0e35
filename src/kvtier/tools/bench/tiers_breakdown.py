"""Where an L2 hit's time goes, from the replica's own connector metrics (`kvtier bench tiers
--breakdown`).

Around each L2 hit the benchmark reads the replica's `/metrics` before and after; the deltas of
`kvtier_connector_hit_phase_seconds_total` (per phase), `kvtier_connector_load_seconds` and
`kvtier_connector_lookup_deferred_steps_total` split the request's TTFT into:

    lookup_wait  the scheduler waiting for the existence checks (steps answered "still looking")
    queue        the planned load waiting for its loader (step boundary, metadata to the worker)
    open         opening files, reading and validating headers
    read         reading payloads (from the page cache, or through FUSE)
    checksum     hashing payloads
    copy         copying payloads into vLLM's KV cache before the forward pass
    load_other   the rest of the load (per-block bookkeeping)
                 (with reads in parallel, open/read/checksum/copy are thread-seconds, scaled
                 down to the load's wall time when they add up to more)
    layer_wait   the forward pass waiting for the layered copy (`load_layerwise`)
    engine       everything else: vLLM computing the prompt's tail, sampling, the HTTP response
                 (compare with plain vLLM's L0 hit, which is all "engine")

One replica serves one request at a time in the benchmark, so the deltas are that request's.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.tools.bench.client import call

__all__ = [
    "PHASES",
    "Breakdown",
    "breakdown_rows",
    "breakdown_table",
    "parse_samples",
    "save_cpu",
    "scrape",
    "write_chart",
]

PHASES = (
    "lookup_wait",
    "queue",
    "open",
    "read",
    "checksum",
    "copy",
    "load_other",
    "layer_wait",
    "engine",
)
_MEASURED = ("lookup", "lookup_wait", "queue", "open", "read", "checksum", "copy", "layer_wait")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_KEYED_BY = ("phase", "tier")
"""Labels a scraped sample is keyed by (all other labels are summed over)."""


def scrape(url: str) -> dict[str, float]:
    """The kvtier connector samples of a server's `/metrics` (see `parse_samples`)."""
    status, body = call(url, "/metrics")
    return parse_samples(body.decode(errors="replace")) if status == 200 else {}


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text as {"name" or "name{phase=x}": value} for `kvtier_connector_*` samples,
    keyed by their `phase` or `tier` label and summed over all others (engine, model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or not m.group(1).startswith("kvtier_connector_"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        keyed = [f"{k}={labels[k]}" for k in _KEYED_BY if k in labels]
        key = m.group(1) + (f"{{{','.join(keyed)}}}" if keyed else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def save_cpu(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a replica's saves cost between two scrapes: blocks saved, and the CPU seconds of
    the saver (copy out of vLLM's cache into L1) and of the L2 writers, per block in ms."""
    blocks = after.get("kvtier_connector_saved_blocks_total", 0.0) - before.get(
        "kvtier_connector_saved_blocks_total", 0.0
    )
    out = {"saved_blocks": blocks}
    for name in ("save_cpu_seconds", "l2_write_cpu_seconds"):
        key = f"kvtier_connector_{name}_total"
        seconds = after.get(key, 0.0) - before.get(key, 0.0)
        out[name] = round(seconds, 3)
        out[f"{name.removesuffix('_seconds')}_ms_per_block"] = (
            round(1000 * seconds / blocks, 2) if blocks else 0.0
        )
    return out


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One L2 hit: its TTFT and the deltas of the replica's counters around it."""

    system: str
    tokens: int
    ttft_ms: float
    phases_ms: dict[str, float]
    load_ms: float
    deferred_steps: float
    blocks: float

    @classmethod
    def measure(
        cls,
        system: str,
        tokens: int,
        ttft_ms: float,
        url: str,
        before: dict[str, float],
        timeout_s: float = 3.0,
    ) -> Breakdown:
        """The deltas since `before`, once the load's figures reached `/metrics` (vLLM passes
        the worker's stats on with a step's outputs; `timeout_s` bounds the wait)."""
        count = "kvtier_connector_load_seconds_count"
        deadline = time.monotonic() + timeout_s
        after = scrape(url)
        while after.get(count, 0.0) <= before.get(count, 0.0) and time.monotonic() < deadline:
            time.sleep(0.05)
            after = scrape(url)

        def delta(key: str) -> float:
            return max(0.0, after.get(key, 0.0) - before.get(key, 0.0))

        phases = {
            p: 1000 * delta(f"kvtier_connector_hit_phase_seconds_total{{phase={p}}}")
            for p in _MEASURED
        }
        return cls(
            system=system,
            tokens=tokens,
            ttft_ms=ttft_ms,
            phases_ms=phases,
            load_ms=1000 * delta("kvtier_connector_load_seconds_sum"),
            deferred_steps=delta("kvtier_connector_lookup_deferred_steps_total"),
            blocks=delta("kvtier_connector_loaded_blocks_total{tier=l2}")
            + delta("kvtier_connector_loaded_blocks_total{tier=l1}"),
        )

    def split(self) -> dict[str, float]:
        """The TTFT split into `PHASES` (ms; they add up to the TTFT). Reads running in
        parallel count thread-seconds: when the load's phases add up to more than its wall
        time, they are scaled down to it, keeping their proportions."""
        p = self.phases_ms
        parts = {k: p[k] for k in ("lookup_wait", "queue")}
        io = {k: p[k] for k in ("open", "read", "checksum", "copy")}
        scale = min(1.0, self.load_ms / sum(io.values())) if sum(io.values()) else 1.0
        parts.update({k: v * scale for k, v in io.items()})
        parts["load_other"] = max(0.0, self.load_ms - sum(io.values()) * scale)
        parts["layer_wait"] = p["layer_wait"]
        waited = p["lookup_wait"] + p["queue"] + self.load_ms + p["layer_wait"]
        parts["engine"] = max(0.0, self.ttft_ms - waited)
        return parts


def breakdown_rows(records: Sequence[Breakdown]) -> list[dict[str, Any]]:
    """Per system and length: the median of every part over the runs (JSON rows)."""
    groups: dict[tuple[str, int], list[Breakdown]] = {}
    for r in records:
        groups.setdefault((r.system, r.tokens), []).append(r)
    rows = []
    for (system, tokens), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        splits = [r.split() for r in group]
        row: dict[str, Any] = {
            "breakdown": system,
            "tokens": tokens,
            "runs": len(group),
            "ttft_ms": round(statistics.median(r.ttft_ms for r in group), 1),
            "load_ms": round(statistics.median(r.load_ms for r in group), 1),
            "lookup_ms": round(statistics.median(r.phases_ms["lookup"] for r in group), 2),
            "deferred_steps": statistics.median(r.deferred_steps for r in group),
            "blocks": statistics.median(r.blocks for r in group),
        }
        for phase in PHASES:
            row[f"{phase}_ms"] = round(statistics.median(s[phase] for s in splits), 2)
        rows.append(row)
    return rows


def breakdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of `breakdown_rows`."""
    head = ["tokens", "system", "ttft", *PHASES, "load", "lookup", "steps", "blocks"]
    lines = [" ".join(f"{h:>11}" for h in head)]
    for r in rows:
        cells = [
            str(r["tokens"]),
            str(r["breakdown"])[:11],
            f"{r['ttft_ms']:.1f}",
            *(f"{r.get(f'{p}_ms', 0.0):.1f}" for p in PHASES),
            f"{r['load_ms']:.1f}",
            f"{r['lookup_ms']:.2f}",
            f"{r['deferred_steps']:g}",
            f"{r['blocks']:g}",
        ]
        lines.append(" ".join(f"{c:>11}" for c in cells))
    return "\n".join(lines)


def write_chart(rows: Sequence[dict[str, Any]], path: Path, title: str | None = None) -> None:
    """Horizontal stacked bars: one per system and length, one segment per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#8c564b", "#e377c2", "#bcbd22", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    colors += ["#d62728", "#c7c7c7"]  # layer_wait; engine: what an L0 hit costs too
    labels = [f"{r['tokens']} tok  {r['breakdown']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for phase, color in zip(PHASES, colors, strict=True):
        widths = [float(r.get(f"{phase}_ms", 0.0)) for r in rows]  # (older rows lack some)
        ax.barh(labels, widths, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("time to first token, ms (median of runs)")
    ax.set_title(title or "Where an L2 hit's time goes")
    ax.legend(ncol=4, fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
