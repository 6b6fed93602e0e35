"""Cache-aware strategies: choose the replica of lowest cost, over a prefix match.

Cost of sending a request to replica r (lower is better), in prefill tokens:

    cost(r) = u(r) = max(0, prompt_tokens - Σ_blocks credit(tier) · block_tokens)   uncached
            + queue_weight    · queued_prefill_tokens(r)                   work ahead of it
            + running_penalty · in_flight(r)                               decode slots taken
            + history_weight  · u(r) · max(0, recent(r) / mean_recent - 1)   over its share

credit: L0 1.0, L1 0.8, L2 0.5 over the replica's longest contiguous cached prefix (a block in
the shared L2 counts for every replica). `recent(r)` is the uncached prefill this policy sent to
r, halved every `history_half_life_s`; a replica that got more than the mean pays extra for new
uncached work in proportion to its excess. That spreads cold prefixes by the future load they
bring (instantaneous load alone places them by whoever happens to be idle that instant, and
affinity then locks in a lopsided split), while a warm request, whose uncached part is small,
still goes to its cache. When every request shares one first block (a system prompt), the
load terms outweigh that block's credit as soon as its replica has a request queued, so the
prefix spreads instead of hot-spotting; the speculative insert then makes the second replica
equally attractive.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.router.index import PrefixIndex
from kvtier.router.policies.base import (
    CostWeights,
    Decision,
    History,
    ReplicaView,
    RouteRequest,
    cached_tokens,
    healthy_sorted,
    pick_min,
)

__all__ = ["CostPolicy", "KVAwarePolicy", "PrefixAwarePolicy"]


class CostPolicy:
    """Choose by the cost formula over a prefix match; subclasses say where matches come from."""

    name = "cost"

    def __init__(self, weights: CostWeights | None = None, max_blocks: int = 1_000_000) -> None:
        self.weights = weights or CostWeights()
        self.speculative = PrefixIndex(max_blocks)
        """What this policy routed, inserted as L0 at route time."""
        self._history = History(self.weights.history_half_life_s)
        self._credits = self.weights.credits()

    def _match(self, request: RouteRequest, names: list[str]) -> dict[str, list[Tier]]:
        return self.speculative.match(request.hashes, replicas=names)

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        w = self.weights
        healthy = healthy_sorted(replicas)
        matches = self._match(request, [r.name for r in healthy])
        recent = {r.name: self._history.value(r.name, now) for r in healthy}
        mean_recent = sum(recent.values()) / len(healthy)
        costs: dict[str, float] = {}
        for r in healthy:
            credit = (
                sum(map(self._credits.__getitem__, matches.get(r.name, ()))) * request.block_tokens
            )
            uncached = max(0.0, request.prompt_tokens - credit)
            excess = max(0.0, recent[r.name] / mean_recent - 1.0) if mean_recent > 0 else 0.0
            costs[r.name] = (
                uncached * (1.0 + w.history_weight * excess)
                + w.queue_weight * r.queued_prefill_tokens
                + w.running_penalty * r.in_flight
            )
        chosen = pick_min(costs, w.tie_tokens, rng)
        cached = {name: cached_tokens(matches.get(name, ()), request) for name in costs}
        best = max(cached.values())
        reason = "cold" if best == 0 else "prefix-hit" if cached[chosen] == best else "load"
        return Decision(chosen, reason, cached[chosen])

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self.speculative.insert(decision.replica, request.hashes, Tier.L0, now)
        self._history.add(decision.replica, request.prompt_tokens - decision.cached_tokens, now)

    def forget(self, replica: str) -> None:
        self.speculative.purge(replica)
        self._history.forget(replica)


class PrefixAwarePolicy(CostPolicy):
    """Approximate index: what this router itself routed (blind to evictions), LRU-bounded."""

    name = "prefixaware"


class KVAwarePolicy(CostPolicy):
    """Precise index fed by the replicas' KV events (tiers L0/L1/L2), plus speculative entries.

    Speculative entries cover the gap until the events arrive and expire after
    `speculative_ttl_s`; the event-fed `index` is shared with the router's event consumer.
    """

    name = "kvaware"

    def __init__(
        self,
        index: PrefixIndex | None = None,
        weights: CostWeights | None = None,
        max_blocks: int = 1_000_000,
        speculative_ttl_s: float = 10.0,
    ) -> None:
        super().__init__(weights, max_blocks)
        if speculative_ttl_s <= 0:
            raise ConfigError(f"speculative_ttl_s: must be positive, got {speculative_ttl_s}")
        self.index = index if index is not None else PrefixIndex(max_blocks)
        self.speculative_ttl_s = speculative_ttl_s

    def _match(self, request: RouteRequest, names: list[str]) -> dict[str, list[Tier]]:
        return self.index.match(request.hashes, also=(self.speculative,), replicas=names)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self.speculative.expire(now - self.speculative_ttl_s)
        super().observe_routed(request, decision, now)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        self.index.purge(replica)
