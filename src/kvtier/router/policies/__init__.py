"""Routing strategies: small plug-ins with a `name` and one decision method, looked up by name.

base     the contract (`Policy`), what a decision sees and returns, shared helpers
cost     prefixaware, kvaware: the lowest cost of uncached prefill plus load
simple   prefixonly (the simulator's hot-spot baseline), leastload, roundrobin, session
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.errors import ConfigError
from kvtier.router.policies.base import (
    CostWeights,
    Decision,
    Policy,
    ReplicaView,
    RouteRequest,
    work_tokens,
)
from kvtier.router.policies.cost import CostPolicy, KVAwarePolicy, PrefixAwarePolicy
from kvtier.router.policies.simple import (
    LeastLoadPolicy,
    PrefixOnlyPolicy,
    RoundRobinPolicy,
    SessionPolicy,
)

__all__ = [
    "POLICIES",
    "CostPolicy",
    "CostWeights",
    "Decision",
    "KVAwarePolicy",
    "LeastLoadPolicy",
    "Policy",
    "PrefixAwarePolicy",
    "PrefixOnlyPolicy",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouteRequest",
    "SessionPolicy",
    "make_policy",
    "work_tokens",
]

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
