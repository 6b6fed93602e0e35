"""Routing strategies: small plug-ins with a `name` and one decision method.

Contract (shared by the router and the fleet simulator, which replays traces through this code):

- `choose(request, replicas, rng, now) -> Decision` picks one healthy replica. It has no side
  effects: the router may call it again with the failed replica marked unhealthy (failover).
  Raises `RoutingError` when no replica is healthy.
- `observe_routed(request, decision, now)` records a decision that was acted upon: speculative
  index inserts (so a burst of siblings lands together before KV events arrive), the round-robin
  cursor, sticky sessions, recent-work history.
- `forget(replica)` drops what the policy knows of a replica (it restarted, cleared or left).

No I/O, no wall-clock reads (`now` is passed in), no global random (`rng` is passed in). Ties are
broken at random among replicas sorted by name, never "first wins" (a hot spot).

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

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.core.errors import ConfigError, RoutingError
from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import Tier
from kvtier.router.index import PrefixIndex

__all__ = [
    "POLICIES",
    "CostPolicy",
    "CostWeights",
    "Decision",
    "Policy",
    "ReplicaView",
    "RouteRequest",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """A replica as the router sees it at decision time."""

    name: str
    in_flight: int
    """Requests currently running or queued on it (as the router counts them)."""
    queued_prefill_tokens: int
    """Uncached prompt tokens routed to it whose first token has not come back yet."""
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class RouteRequest:
    hashes: tuple[BlockHash, ...]
    """kvtier block hashes of the prompt (`keys.block_hashes` at the engine block size)."""
    block_tokens: int
    """Tokens per hashed block."""
    prompt_tokens: int
    session: str | None = None
    """Sticky key (a header or the OpenAI `user` field), used by `session`."""


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    reason: str
    """Why: "prefix-hit", "load" (spilled off a cached replica), "cold" (no replica cached),
    "session", "roundrobin"."""
    cached_tokens: int
    """Prompt tokens the policy expects to be served from cache there."""


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Weights of the cost formula (module docstring); every term is in prefill tokens."""

    l0_credit: float = 1.0
    """Fraction of a block's tokens saved when the replica's engine (GPU/L0) holds it."""
    l1_credit: float = 0.8
    """... when the replica's host-memory tier holds it (a copy in, no compute)."""
    l2_credit: float = 0.5
    """... when the shared pool holds it (a network read)."""
    queue_weight: float = 0.25
    """Cost per uncached prompt token already queued on the replica. Below 1 on purpose: a
    queue only delays a request, a miss also recomputes its prefix (fleet compute) and caches
    it twice; at 0.25 affinity yields once the cached replica's backlog exceeds about four
    times the prefill the cache saves."""
    running_penalty: float = 128.0
    """Cost per request in flight on the replica (one block of prefill)."""
    history_weight: float = 2.0
    """Extra cost per uncached token per unit of the replica's excess share of recent uncached
    prefill (spreads cold prefixes by the load they bring)."""
    history_half_life_s: float = 10.0
    """Half-life of the recent-work history."""
    tie_tokens: float = 1.0
    """Costs closer than this are a tie, broken at random."""

    def __post_init__(self) -> None:
        for name in ("l0_credit", "l1_credit", "l2_credit"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}: must be within [0, 1], got {value}")
        for name in ("queue_weight", "running_penalty", "history_weight", "tie_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must not be negative, got {getattr(self, name)}")
        if self.history_half_life_s <= 0:
            raise ConfigError(
                f"history_half_life_s: must be positive, got {self.history_half_life_s}"
            )

    def credits(self) -> dict[Tier, float]:
        return {Tier.L0: self.l0_credit, Tier.L1: self.l1_credit, Tier.L2: self.l2_credit}


class Policy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision: ...

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None: ...

    def forget(self, replica: str) -> None: ...


# ----- helpers shared by the strategies -----


def _healthy(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """Healthy replicas sorted by name, so a seeded rng gives the same pick in any view order."""
    healthy = sorted((r for r in replicas if r.healthy), key=lambda r: r.name)
    if not healthy:
        raise RoutingError("no healthy replica")
    return healthy


def _pick_min(costs: dict[str, float], tolerance: float, rng: random.Random) -> str:
    """A random replica among those within `tolerance` of the lowest cost."""
    low = min(costs.values())
    tied = sorted(name for name, cost in costs.items() if cost <= low + tolerance)
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _cached_tokens(tiers: Sequence[Tier], request: RouteRequest) -> int:
    return min(len(tiers) * request.block_tokens, request.prompt_tokens)


class _History:
    """Uncached prefill recently sent to each replica, halved every `half_life_s`."""

    def __init__(self, half_life_s: float) -> None:
        self._rate = math.log(2) / half_life_s
        self._work: dict[str, tuple[float, float]] = {}  # replica -> (value, as of time)

    def value(self, replica: str, now: float) -> float:
        value, at = self._work.get(replica, (0.0, now))
        return value * math.exp(-self._rate * max(0.0, now - at))

    def add(self, replica: str, tokens: float, now: float) -> None:
        self._work[replica] = (self.value(replica, now) + tokens, now)

    def forget(self, replica: str) -> None:
        self._work.pop(replica, None)


# ----- cache-aware strategies -----


class CostPolicy:
    """Choose by the cost formula over a prefix match; subclasses say where matches come from."""

    name = "cost"

    def __init__(self, weights: CostWeights | None = None, max_blocks: int = 1_000_000) -> None:
        self.weights = weights or CostWeights()
        self.speculative = PrefixIndex(max_blocks)
        """What this policy routed, inserted as L0 at route time."""
        self._history = _History(self.weights.history_half_life_s)
        self._credits = self.weights.credits()

    def _match(self, request: RouteRequest, names: list[str]) -> dict[str, list[Tier]]:
        return self.speculative.match(request.hashes, replicas=names)

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        w = self.weights
        healthy = _healthy(replicas)
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
        chosen = _pick_min(costs, w.tie_tokens, rng)
        cached = {name: _cached_tokens(matches.get(name, ()), request) for name in costs}
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


class PrefixOnlyPolicy:
    """Longest cached prefix wins, load ignored: the hot-spotting baseline the simulator shows."""

    name = "prefixonly"

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.index = PrefixIndex(max_blocks)

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = _healthy(replicas)
        matches = self.index.match(request.hashes, replicas=[r.name for r in healthy])
        lengths = {r.name: float(len(matches.get(r.name, ()))) for r in healthy}
        chosen = _pick_min({name: -n for name, n in lengths.items()}, 0.0, rng)
        cached = _cached_tokens(matches.get(chosen, ()), request)
        return Decision(chosen, "prefix-hit" if cached else "cold", cached)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self.index.insert(decision.replica, request.hashes, Tier.L0, now)

    def forget(self, replica: str) -> None:
        self.index.purge(replica)


# ----- cache-blind strategies -----


class LeastLoadPolicy:
    """Fewest requests in flight, then fewest queued prefill tokens; random among equals."""

    name = "leastload"

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = _healthy(replicas)
        low = min((r.in_flight, r.queued_prefill_tokens) for r in healthy)
        tied = [r.name for r in healthy if (r.in_flight, r.queued_prefill_tokens) == low]
        return Decision(tied[0] if len(tied) == 1 else rng.choice(tied), "load", 0)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class RoundRobinPolicy:
    """Healthy replicas in name order, one after another; cache state ignored."""

    name = "roundrobin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = _healthy(replicas)
        return Decision(healthy[self._turn % len(healthy)].name, "roundrobin", 0)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self._turn += 1

    def forget(self, replica: str) -> None:
        pass


class SessionPolicy:
    """Sticky by session key (a header or `user`); new or orphaned sessions go to least load."""

    name = "session"

    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions <= 0:
            raise ConfigError(f"max_sessions: must be positive, got {max_sessions}")
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> replica, LRU
        self._fallback = LeastLoadPolicy()

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = _healthy(replicas)
        if request.session is not None:
            replica = self._sessions.get(request.session)
            if replica is not None and any(r.name == replica for r in healthy):
                return Decision(replica, "session", 0)
        return self._fallback.choose(request, healthy, rng, now)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        if request.session is None:
            return
        self._sessions[request.session] = decision.replica
        self._sessions.move_to_end(request.session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget(self, replica: str) -> None:
        pass  # sessions re-pin lazily when their replica is no longer healthy


POLICIES: dict[str, Callable[..., Policy]] = {
    PrefixAwarePolicy.name: PrefixAwarePolicy,
    KVAwarePolicy.name: KVAwarePolicy,
    SessionPolicy.name: SessionPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
    PrefixOnlyPolicy.name: PrefixOnlyPolicy,
}
"""Strategy name -> constructor; `prefixonly` is the simulator's hot-spot baseline."""


def make_policy(name: str, **options: object) -> Policy:
    """Build a strategy by name; `options` are its constructor's keywords."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"strategy: unknown {name!r}; choose from {', '.join(sorted(POLICIES))}"
        ) from None
    try:
        return factory(**options)
    except TypeError as exc:
        raise ConfigError(f"strategy {name}: {exc}") from exc
