"""Capacity planning: the smallest tier capacity that reaches a target block hit rate.

Bisection over the capacity of one tier (the others stay as configured), each probe a full
simulation. It relies on the hit rate growing with capacity, which holds exactly for LRU on one
replica (an LRU cache of n blocks always holds a subset of one of n+1 blocks under the same
accesses) and in practice for fleets. The search space is [0, distinct blocks of the trace]:
a tier that large never evicts, so it behaves as infinite. Probes stop when the bracket is
narrower than `tolerance` of its upper end (or one block).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.tools.sim.cost_model import CostModel
from kvtier.tools.sim.simulator import FleetConfig, simulate
from kvtier.tools.sim.trace import Trace

__all__ = ["PlanAnswer", "plan_capacity"]


@dataclass(frozen=True, slots=True)
class PlanAnswer:
    tier: str
    target_hit_rate: float
    reachable: bool
    """False when even an unbounded tier misses the target (raise another tier or replicas)."""
    blocks: int | None
    """Smallest capacity found (per replica for l0/l1, for the pool for l2); None if unreachable."""
    hit_rate: float
    """Hit rate at `blocks` (at unbounded capacity when unreachable)."""
    bytes: int | None
    """`blocks` in KV bytes of the cost profile (blocks x block tokens x bytes per token)."""
    probes: list[tuple[object, float]]
    """(capacity, hit rate) of every simulation run, in order; "inf" for unbounded."""

    def summary(self) -> str:
        if self.blocks is None or self.bytes is None:
            return (
                f"{self.tier}: target {self.target_hit_rate:.1%} is out of reach; an "
                f"unbounded {self.tier} gives {self.hit_rate:.1%}"
            )
        return (
            f"{self.tier}: {self.blocks} blocks ({self.bytes / 2**30:.1f} GiB) reach "
            f"{self.hit_rate:.1%} >= target {self.target_hit_rate:.1%} "
            f"({len(self.probes)} simulations)"
        )


def plan_capacity(
    trace: Trace,
    base: FleetConfig,
    costs: CostModel,
    tier: Tier,
    target: float,
    *,
    tolerance: float = 0.02,
    on_probe: Callable[[object, float], None] | None = None,
) -> PlanAnswer:
    if not 0.0 < target <= 1.0:
        raise ConfigError(f"target_hit_rate: must be within (0, 1], got {target}")
    if not 0.0 <= tolerance < 1.0:
        raise ConfigError(f"tolerance: must be within [0, 1), got {tolerance}")
    field_name = f"{tier.value}_blocks"
    probes: list[tuple[object, float]] = []

    def hit_rate(blocks: float) -> float:
        changes: dict[str, Any] = {field_name: blocks}
        rate = simulate(trace, replace(base, **changes), costs).hit_rate
        label: object = "inf" if math.isinf(blocks) else int(blocks)
        probes.append((label, rate))
        if on_probe is not None:
            on_probe(label, rate)
        return rate

    def answer(blocks: int | None, rate: float) -> PlanAnswer:
        size = None if blocks is None else blocks * trace.block_tokens * costs.kv_bytes_per_token
        return PlanAnswer(tier.value, target, blocks is not None, blocks, rate, size, probes)

    best = hit_rate(math.inf)
    if best < target:
        return answer(None, best)
    low_rate = hit_rate(0)
    if low_rate >= target:
        return answer(0, low_rate)
    lo, hi, hi_rate = 0, trace.unique_blocks(), best  # hit(lo) < target <= hit(hi)
    while hi - lo > max(1.0, tolerance * hi):
        mid = max(lo + 1, min(hi - 1, int(math.sqrt(max(lo, 1) * hi))))
        rate = hit_rate(mid)
        if rate >= target:
            hi, hi_rate = mid, rate
        else:
            lo = mid
    return answer(hi, hi_rate)
