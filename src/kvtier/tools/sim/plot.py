"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

Three panels share the swept values as evenly spaced categories (so 0 and "inf" capacities
and strategy names sit on one axis): block hit rate (with the trace's ideal as a dashed line),
TTFT p50 (solid) and p99 (dashed) on a log scale, and load max/mean per replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError

__all__ = ["plot_sweep"]

_X_LABELS = {
    "l0": "L0 blocks per replica",
    "l1": "L1 blocks per replica",
    "l2": "shared L2 blocks",
    "replicas": "replicas",
    "strategy": "strategy",
    "seed": "seed",
}


def plot_sweep(doc: Mapping[str, Any], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: list[dict[str, Any]] = list(doc["points"])
    xs: list[object] = list(dict.fromkeys(p["x"] for p in points))
    series: list[object] = list(dict.fromkeys(p["series"] for p in points))
    fig, (ax_hit, ax_ttft, ax_load) = plt.subplots(1, 3, figsize=(15, 4.2))
    joined = "-" if doc["x"] != "strategy" else "none"  # categories are not a continuum
    for s in series:
        mine = [p for p in points if p["series"] == s]
        pos = [xs.index(p["x"]) for p in mine]
        label = f"{doc['series']}={s}" if s is not None else None
        (line,) = ax_hit.plot(
            pos, [p["hit_rate"] for p in mine], marker="o", linestyle=joined, label=label
        )
        color = line.get_color()
        ax_ttft.plot(
            pos,
            [p["ttft_p50_ms"] for p in mine],
            marker="o",
            linestyle=joined,
            color=color,
            label=f"{label or ''} p50".strip(),
        )
        ax_ttft.plot(
            pos,
            [p["ttft_p99_ms"] for p in mine],
            marker="x",
            linestyle="--" if joined == "-" else "none",
            color=color,
            label=f"{label or ''} p99".strip(),
        )
        ax_load.plot(
            pos,
            [p["load_max_over_mean"] for p in mine],
            marker="o",
            linestyle=joined,
            color=color,
            label=label,
        )
    ideal = float(points[0]["ideal_hit_rate"])
    ax_hit.axhline(ideal, color="grey", linestyle="--", label=f"ideal {ideal:.1%}")
    ax_hit.set_ylabel("block hit rate")
    ax_hit.set_ylim(0, max(ideal * 1.1, 0.05))
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.set_yscale("log")
    ax_load.set_ylabel("requests: max / mean per replica")
    ax_load.set_ylim(bottom=0.9)
    for ax in (ax_hit, ax_ttft, ax_load):
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_xlabel(_X_LABELS.get(str(doc["x"]), str(doc["x"])))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
