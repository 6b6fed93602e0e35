"""What a kvtier Prometheus metric is, declared once as data.

Each component lists its metrics as `MetricDef`s and builds its collectors from that list (the
router in `kvtier.router.metrics`, the connector and the L2 janitor in `kvtier.vllm.stats`);
`docs/metrics.md` is rendered from the same lists (`kvtier.tools.monitoring`) and a test fails on
any difference, so the catalogue cannot drift from the code.

Conventions (Prometheus): names in base units (`_seconds`, `_bytes`), a counter is exposed with
`_total` (declared without it, as prometheus_client wants), label values from small fixed sets
or the fleet's replicas only. Colons are left to recording rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["LATENCY_BUCKETS", "MetricDef", "MetricKind"]

MetricKind = Literal["counter", "gauge", "histogram"]

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
"""Seconds, from a fraction of a millisecond (the router's hop, an L1 load) to minutes."""

_NAME = re.compile(r"^kvtier_[a-z0-9_]+$")


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    """Family name; a counter's samples are exposed as `<name>_total`."""
    kind: MetricKind
    help: str
    """One sentence: what is counted or measured, and when."""
    labels: tuple[str, ...] = ()
    values: str = ""
    """The label values that occur (for the catalogue), e.g. "tier: l1, l2"."""
    buckets: tuple[float, ...] = ()
    """Histogram bucket upper bounds."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name: {self.name!r} is not kvtier_<lower_snake_case>")
        if self.kind == "counter" and self.name.endswith("_total"):
            raise ValueError(f"name: counter {self.name!r} is declared without _total")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"buckets: {self.name!r}: histograms, and only they, have buckets")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets: {self.name!r}: must increase strictly")

    @property
    def exposed(self) -> str:
        """The name samples carry (`_total` added to counters; a histogram's base name)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    @property
    def sample_names(self) -> tuple[str, ...]:
        """Every sample name the family produces on a /metrics page."""
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.exposed,)
