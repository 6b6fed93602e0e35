"""Sweeps: rerun the simulation over a list of values of one or two fleet parameters.

`--sweep l1=0,1000,10000,inf` varies the per-replica L1 capacity (the hit-rate-vs-capacity
curve); `--sweep replicas=1,2,4,8,16` the fleet size (the TTFT-vs-replicas curve). A second
`--sweep` (e.g. `strategy=kvaware,roundrobin`) draws one series per value. Each point keeps the
run's summary (its per-replica detail is dropped to keep the file small).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tools.sim.cost_model import CostModel
from kvtier.tools.sim.simulator import FleetConfig, simulate
from kvtier.tools.sim.trace import Trace

__all__ = ["SWEEPABLE", "SweepAxis", "parse_capacity", "parse_sweep", "run_sweep"]


def parse_capacity(text: str) -> float:
    """A capacity in blocks: a whole number >= 0 or "inf"."""
    if text.strip().lower() in {"inf", "infinity"}:
        return math.inf
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(
            f"capacity: expected a whole number of blocks or inf, got {text!r}"
        ) from None
    if value < 0:
        raise ConfigError(f"capacity: must be >= 0, got {value}")
    return float(value)


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"sweep: expected a whole number, got {text!r}") from None


SWEEPABLE: dict[str, tuple[str, Callable[[str], object]]] = {
    "l0": ("l0_blocks", parse_capacity),
    "l1": ("l1_blocks", parse_capacity),
    "l2": ("l2_blocks", parse_capacity),
    "replicas": ("replicas", _count),
    "strategy": ("strategy", str),
    "seed": ("seed", _count),
}
"""Sweep name -> (FleetConfig field, value parser)."""


@dataclass(frozen=True, slots=True)
class SweepAxis:
    name: str
    """A key of `SWEEPABLE`."""
    values: tuple[object, ...]

    def apply(self, config: FleetConfig, value: object) -> FleetConfig:
        changes: dict[str, Any] = {SWEEPABLE[self.name][0]: value}
        return replace(config, **changes)


def parse_sweep(text: str) -> SweepAxis:
    """`NAME=V1,V2,...`, e.g. `l1=0,1000,inf` or `replicas=1,2,4`."""
    name, sep, raw = text.partition("=")
    if name not in SWEEPABLE or not sep:
        raise ConfigError(
            f"sweep: expected NAME=V1,V2,... with NAME one of {', '.join(SWEEPABLE)}; got {text!r}"
        )
    parse = SWEEPABLE[name][1]
    values = tuple(parse(v) for v in raw.split(",") if v.strip())
    if not values:
        raise ConfigError(f"sweep: no values for {name}")
    return SweepAxis(name, values)


def _label(value: object) -> object:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else int(value)
    return value


def run_sweep(
    trace: Trace,
    base: FleetConfig,
    costs: CostModel,
    axes: Sequence[SweepAxis],
    *,
    progress: bool = False,
    on_point: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Simulate every combination; returns {"x", "series", "points": [...]} for JSON and plots."""
    if not 1 <= len(axes) <= 2:
        raise ConfigError(f"sweep: give one or two --sweep axes, got {len(axes)}")
    x_axis = axes[0]
    series_axis = axes[1] if len(axes) == 2 else None
    points: list[dict[str, Any]] = []
    for series in series_axis.values if series_axis else (None,):
        config = series_axis.apply(base, series) if series_axis else base
        for x in x_axis.values:
            result = simulate(trace, x_axis.apply(config, x), costs, progress=progress)
            point = {"x": _label(x), "series": _label(series), **result.to_dict()}
            del point["replicas"]
            points.append(point)
            if on_point is not None:
                on_point(point)
    return {"x": x_axis.name, "series": series_axis.name if series_axis else None, "points": points}
