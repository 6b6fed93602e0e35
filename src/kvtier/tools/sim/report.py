"""What one simulation run measured, as JSON for files and as text for people."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvtier.core.errors import ConfigError

__all__ = [
    "ReplicaReport",
    "SimResult",
    "max_over_mean",
    "percentile_ms",
    "prepare_output",
    "write_output",
]


def prepare_output(path: Path, flag: str, *, directory: bool = False) -> None:
    """Make the directory that the file `path` (with `directory`: the directory `path`) goes
    into, before a long run writes it at its end; a `ConfigError` naming `flag` if it cannot be
    made or written into, or if the file `path` is a directory."""
    parent = path if directory else path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{flag} {path}: {parent} is not a directory") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not directory and path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write into {parent}")


def write_output(path: Path, text: str) -> None:
    """Write `text` to `path` (making its parents); a `ConfigError` naming `path` if it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    name: str
    requests: int
    """Requests routed to it."""
    busy_s: float
    """Simulated seconds it spent loading and prefilling."""
    prefill_tokens: int
    """Prompt tokens it computed (not served from a cache)."""


@dataclass(frozen=True, slots=True)
class SimResult:
    requests: int
    blocks: int
    """Prompt blocks of all requests (trace hash ids)."""
    hit_rate: float
    """Blocks served from any cache tier over all blocks."""
    ideal_hit_rate: float
    """Blocks seen earlier in the trace over all blocks (one infinite cache)."""
    hit_rate_by_tier: dict[str, float]
    """Per tier ("l0", "l1", "l2"): blocks served from it over all blocks."""
    token_hit_rate: float
    """Prompt tokens served from cache over all prompt tokens."""
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    queue_p50_ms: float
    """Time from arrival until the replica starts the request (median)."""
    queue_p99_ms: float
    load_max_over_mean: float
    """Requests routed to the busiest replica over the mean per replica."""
    work_max_over_mean: float
    """Same for busy seconds (loads + prefill)."""
    reasons: dict[str, int]
    """Routing decisions by the policy's stated reason."""
    replicas: list[ReplicaReport]
    sim_span_s: float
    """Simulated seconds from the first arrival to the last first token."""
    wall_s: float
    """Wall-clock seconds the simulation took."""
    cpu_s: float
    """CPU seconds of this process during the simulation (wall time minus contention)."""
    config: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def summary(self) -> str:
        tiers = " ".join(f"{t}={v:.1%}" for t, v in self.hit_rate_by_tier.items())
        return (
            f"requests {self.requests}  blocks {self.blocks}\n"
            f"hit rate {self.hit_rate:.1%} (ideal {self.ideal_hit_rate:.1%}; {tiers})  "
            f"token hit rate {self.token_hit_rate:.1%}\n"
            f"TTFT p50 {self.ttft_p50_ms:.0f} ms  p90 {self.ttft_p90_ms:.0f} ms  "
            f"p99 {self.ttft_p99_ms:.0f} ms  (queue p50 {self.queue_p50_ms:.0f} ms)\n"
            f"load max/mean {self.load_max_over_mean:.2f} requests, "
            f"{self.work_max_over_mean:.2f} busy time  reasons {self.reasons}\n"
            f"simulated {self.sim_span_s:.0f} s in {self.wall_s:.1f} s wall "
            f"({self.cpu_s:.1f} s CPU)"
        )


def percentile_ms(values_s: Sequence[float], q: float) -> float:
    return float(np.percentile(values_s, q) * 1000.0) if values_s else 0.0


def max_over_mean(values: Sequence[float] | Mapping[str, float]) -> float:
    vals = list(values.values()) if isinstance(values, Mapping) else list(values)
    mean = sum(vals) / len(vals) if vals else 0.0
    return max(vals) / mean if mean > 0 else 1.0
