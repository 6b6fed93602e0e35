"""Strategies that do not weigh cost: the hot-spotting longest-prefix baseline, least load,
round robin and sticky sessions."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvtier.core.errors import ConfigError
from kvtier.core.lru import Lru
from kvtier.core.tiers.base import Tier
from kvtier.router.index import PrefixIndex
from kvtier.router.policies.base import (
    Decision,
    ReplicaView,
    RouteRequest,
    cached_tokens,
    healthy_sorted,
    pick_lowest,
)

__all__ = ["LeastLoadPolicy", "PrefixOnlyPolicy", "RoundRobinPolicy", "SessionPolicy"]


class PrefixOnlyPolicy:
    """Longest cached prefix wins, load ignored: the hot-spotting baseline the simulator shows."""

    name = "prefixonly"

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.index = PrefixIndex(max_blocks)

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = healthy_sorted(replicas)
        matches = self.index.match(request.hashes, replicas=[r.name for r in healthy])
        longest = pick_lowest([-len(matches[r.name]) for r in healthy], 0.0, rng)
        chosen = healthy[longest].name
        cached = cached_tokens(matches[chosen], request)
        return Decision(chosen, "prefix-hit" if cached else "cold", cached)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self.index.insert(decision.replica, request.hashes, Tier.L0, now)

    def forget(self, replica: str) -> None:
        self.index.purge(replica)


class LeastLoadPolicy:
    """Fewest requests in flight, then fewest queued prefill tokens; random among equals."""

    name = "leastload"

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = healthy_sorted(replicas)
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
        healthy = healthy_sorted(replicas)
        return Decision(healthy[self._turn % len(healthy)].name, "roundrobin", 0)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        self._turn += 1

    def forget(self, replica: str) -> None:
        pass


class SessionPolicy:
    """Sticky by session key (a header or `user`); new or orphaned sessions go to least load.

    Sessions are per tenant (the key is (tenant, session)): another tenant naming the same
    session neither joins it, nor learns from where it lands that the session exists, nor
    moves it.
    """

    name = "session"

    def __init__(self, max_sessions: int = 100_000) -> None:
        if max_sessions <= 0:
            raise ConfigError(f"max_sessions: must be positive, got {max_sessions}")
        self._sessions: Lru[tuple[str | None, str], str] = Lru(max_sessions)
        """(tenant, session) -> replica."""
        self._fallback = LeastLoadPolicy()

    def choose(
        self, request: RouteRequest, replicas: Sequence[ReplicaView], rng: random.Random, now: float
    ) -> Decision:
        healthy = healthy_sorted(replicas)
        if request.session is not None:
            replica = self._sessions.peek((request.tenant, request.session))
            if replica is not None and any(r.name == replica for r in healthy):
                return Decision(replica, "session", 0)
        return self._fallback.choose(request, healthy, rng, now)

    def observe_routed(self, request: RouteRequest, decision: Decision, now: float) -> None:
        if request.session is None:
            return
        self._sessions.put((request.tenant, request.session), decision.replica)

    def forget(self, replica: str) -> None:
        pass  # sessions re-pin lazily when their replica is no longer healthy
