"""Cache-aware strategies: choose the replica of lowest cost, over a prefix match.

Cost of sending a request to replica r (lower is better), in prefill tokens:

    cost(r) = n(r) · (1 + history_weight · max(0, recent(r)/mean_recent − 1))  new prefill
            + Σ_blocks (1 − credit(tier)) · block_tokens                     reading its prefix
            + duplicate_weight · (most cached anywhere − cached(r))           computed twice
            + queue_weight    · queued_prefill_tokens(r)                      work ahead of it
            + running_penalty · in_flight(r)                                  decode slots taken

n(r) = prompt_tokens − cached(r), where cached(r) covers the blocks of r's longest contiguous
cached prefix (a block in the shared L2 counts for every replica). Credit is the fraction of a
block's prefill its tier saves: L0 1.0, L1 0.8, L2 0.5, so a cached block still costs the time
to read it. `recent(r)` is the prefill-equivalent work (new tokens plus reads) this policy sent
to r, halved every `history_half_life_s`; a replica that got more than the mean pays extra for
new prefill in proportion to its excess. That spreads cold prefixes by the future load they
bring (instantaneous load alone places them by whoever happens to be idle that instant, and
affinity then locks in a lopsided split).

Why the history term multiplies only the new prefill: reading a cached prefix costs the same
wherever the excess is, and multiplying it too made a long conversation look cheaper to move
off its replica (a read of its whole prefix from L2) than to extend there, the more so the
longer it grew; sessions of hundreds of thousands of tokens then hopped between replicas and
paid those reads (seen in the simulator on `kvtier sim-trace agents` traces).

The duplicate term (kvaware only) prices recomputing what another replica holds or is
computing right now (with the events, blocks not yet in the shared pool: the previous turn of a
conversation still in flight): the fleet then computes those tokens twice, and their hit is
lost. prefixaware cannot tell such blocks from a prefix cached long ago (everything it routed
looks held), so the term would only make it stickier.

When every request shares one first block (a system prompt), the load terms outweigh that
block's credit as soon as its replica has a request queued, so the prefix spreads instead of
hot-spotting; the speculative insert then makes the second replica equally attractive.
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
    healthy_sorted,
    pick_lowest,
    work_tokens,
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
        self._credits = tuple(self.weights.credits().items())
        """(tier, credit) for L0, L1, L2."""
        self._duplicate_weight = 0.0
        """`duplicate_weight` where matches tell in-flight blocks (kvaware), else 0."""

    def _match(self, request: RouteRequest, names: list[str]) -> dict[str, list[Tier]]:
        return self.speculative.match(request.hashes, replicas=names)

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        w = self.weights
        healthy = healthy_sorted(replicas)
        names = [r.name for r in healthy]
        matches = self._match(request, names)
        recent = [self._history.value(name, now) for name in names]
        mean_recent = sum(recent) / len(healthy)
        prompt_tokens, block_tokens = request.prompt_tokens, request.block_tokens
        prefixes = [matches[name] for name in names]
        held = [min(len(tiers) * block_tokens, prompt_tokens) for tiers in prefixes]
        best = max(held)
        (l0, c0), (l1, c1), (l2, c2) = self._credits
        costs: list[float] = []
        works: list[float] = []
        for r, tiers, cached, seen in zip(healthy, prefixes, held, recent, strict=True):
            new = prompt_tokens - cached
            # L0, L1, L2 added in that order: another order could round differently and tip a tie
            credit = block_tokens * (
                tiers.count(l0) * c0 + tiers.count(l1) * c1 + tiers.count(l2) * c2
            )
            reads = max(0.0, cached - credit)
            works.append(new + reads)
            excess = max(0.0, seen / mean_recent - 1.0) if mean_recent > 0 else 0.0
            costs.append(
                new * (1.0 + w.history_weight * excess)
                + reads
                + self._duplicate_weight * (best - cached)
                + w.queue_weight * r.queued_prefill_tokens
                + w.running_penalty * r.in_flight
            )
        i = pick_lowest(costs, w.tie_tokens, rng)
        reason = "cold" if best == 0 else "prefix-hit" if held[i] == best else "load"
        return Decision(names[i], reason, held[i], round(works[i]))

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self.speculative.insert(decision.replica, request.hashes, Tier.L0, now)
        self._history.add(decision.replica, work_tokens(request, decision), now)

    def forget(self, replica: str) -> None:
        self.speculative.purge(replica)
        self._history.forget(replica)


class PrefixAwarePolicy(CostPolicy):
    """Approximate index: what this router itself routed (blind to evictions), LRU-bounded."""

    name = "prefixaware"


class KVAwarePolicy(CostPolicy):
    """Precise index fed by the replicas' KV events (tiers L0/L1/L2), plus speculative entries.

    Speculative entries cover the gap until the events arrive: an event about the same replica,
    block and tier drops them (`PrefixIndex.supersede`), so they last as long as the request
    queues, however long that is; the rest (guesses no event answered: a request that failed
    before its prefill) expire `speculative_ttl_s` after routing. Expiring them on a short
    timer instead lost the prefix of every request that waited longer than the timer (its
    siblings went elsewhere and recomputed it). The event-fed `index` is shared with the
    router's event consumer.
    """

    name = "kvaware"

    def __init__(
        self,
        index: PrefixIndex | None = None,
        weights: CostWeights | None = None,
        max_blocks: int = 1_000_000,
        speculative_ttl_s: float = 300.0,
    ) -> None:
        super().__init__(weights, max_blocks)
        if speculative_ttl_s <= 0:
            raise ConfigError(f"speculative_ttl_s: must be positive, got {speculative_ttl_s}")
        self.index = index if index is not None else PrefixIndex(max_blocks)
        self.index.supersede(self.speculative)
        self.speculative_ttl_s = speculative_ttl_s
        self._duplicate_weight = self.weights.duplicate_weight

    def _match(self, request: RouteRequest, names: list[str]) -> dict[str, list[Tier]]:
        return self.index.match(request.hashes, also=(self.speculative,), replicas=names)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self.speculative.expire(now - self.speculative_ttl_s)
        # a cache hit sends no event: without this, hot prefixes age out of the index first
        held = -(-decision.cached_tokens // request.block_tokens)
        self.index.touch(decision.replica, request.hashes[:held], now)
        super().observe_routed(request, decision, now)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        self.index.purge(replica)
