"""The routing contract and the helpers every strategy shares.

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
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple, Protocol

from kvtier.core.errors import ConfigError, RoutingError
from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import Tier

__all__ = [
    "CostWeights",
    "Decision",
    "History",
    "Policy",
    "ReplicaView",
    "RouteRequest",
    "cached_tokens",
    "healthy_sorted",
    "pick_lowest",
    "work_tokens",
]


class ReplicaView(NamedTuple):
    """A replica as the router sees it at decision time."""

    name: str
    in_flight: int
    """Requests currently running or queued on it (as the router counts them)."""
    queued_prefill_tokens: int
    """Uncached prompt tokens routed to it whose first token has not come back yet."""
    healthy: bool = True


class RouteRequest(NamedTuple):
    """What a strategy sees of a request."""

    hashes: tuple[BlockHash, ...]
    """kvtier block hashes of the prompt (`keys.block_hashes` at the engine block size)."""
    block_tokens: int
    """Tokens per hashed block."""
    prompt_tokens: int
    session: str | None = None
    """Sticky key (a header or the OpenAI `user` field), used by `session`."""
    tenant: str | None = None
    """The API key's tenant (None: a key without one, or no keys): sessions are per tenant."""


class Decision(NamedTuple):
    """A strategy's pick and why."""

    replica: str
    reason: str
    """Why: "prefix-hit", "load" (spilled off a cached replica), "cold" (no replica cached),
    "session", "roundrobin"."""
    cached_tokens: int
    """Prompt tokens the policy expects to be served from cache there."""
    work_tokens: int | None = None
    """Prefill-equivalent work it expects there: new tokens plus the time to read the cached
    ones from slower tiers, in tokens (None: the prompt minus `cached_tokens`). What the
    replica's load counters and the policy's history charge for the request."""


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
    """Extra cost per new prefill token per unit of the replica's excess share of recent work
    (spreads cold prefixes by the load they bring)."""
    history_half_life_s: float = 60.0
    """Half-life of the recent-work history: about how long the prefixes a replica took keep
    coming back (a conversation, an agent session), so its share reflects sustained load."""
    duplicate_weight: float = 1.0
    """Extra cost per token this replica would compute although another one holds it or is
    computing it (the fleet computes it twice, and its hit is lost); kvaware only."""
    tie_tokens: float = 1.0
    """Costs closer than this are a tie, broken at random."""

    def __post_init__(self) -> None:
        for name in ("l0_credit", "l1_credit", "l2_credit"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}: must be within [0, 1], got {value}")
        for name in (
            "queue_weight",
            "running_penalty",
            "history_weight",
            "duplicate_weight",
            "tie_tokens",
        ):
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

_name = attrgetter("name")


def healthy_sorted(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """Healthy replicas sorted by name, so a seeded rng gives the same pick in any view order."""
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise RoutingError("no healthy replica")
    healthy.sort(key=_name)
    return healthy


def pick_lowest(costs: Sequence[float], tolerance: float, rng: random.Random) -> int:
    """The position of a random cost among those within `tolerance` of the lowest; given in
    `healthy_sorted` order, a seeded rng picks the same replica in any view order."""
    low = min(costs)
    tied = [i for i, cost in enumerate(costs) if cost <= low + tolerance]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def cached_tokens(tiers: Sequence[Tier], request: RouteRequest) -> int:
    return min(len(tiers) * request.block_tokens, request.prompt_tokens)


def work_tokens(request: RouteRequest, decision: Decision) -> int:
    """The prefill-equivalent work a decision puts on its replica (`Decision.work_tokens`)."""
    if decision.work_tokens is not None:
        return decision.work_tokens
    return max(0, request.prompt_tokens - decision.cached_tokens)


class History:
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
