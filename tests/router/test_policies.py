"""Routing strategies: exact choices for cache hits, spills, ties, sessions and failures."""

import random
from collections import Counter
from typing import cast

import pytest

from kvtier.core.errors import ConfigError, RoutingError
from kvtier.core.keys import block_hashes
from kvtier.core.tiers.base import Tier
from kvtier.router.index import SHARED, PrefixIndex
from kvtier.router.policies import (
    POLICIES,
    CostPolicy,
    CostWeights,
    Decision,
    ReplicaView,
    RouteRequest,
    make_policy,
)

BLOCK = 16


def request(
    prefix: int, blocks: int = 4, session: str | None = None, tenant: str | None = None
) -> RouteRequest:
    tokens = [prefix * 1000 + i for i in range(blocks * BLOCK)]
    return RouteRequest(tuple(block_hashes(tokens, BLOCK)), BLOCK, len(tokens) + 5, session, tenant)


def idle(*names: str) -> list[ReplicaView]:
    return [ReplicaView(n, in_flight=0, queued_prefill_tokens=0) for n in names]


def route(policy, req: RouteRequest, views, rng: random.Random, now: float = 0.0) -> Decision:
    decision = policy.choose(req, views, rng, now)
    policy.observe_routed(req, decision, now)
    return decision


def test_prefixaware_sends_a_repeated_prefix_back_to_the_replica_that_got_it() -> None:
    policy, rng = make_policy("prefixaware"), random.Random(0)
    first = route(policy, request(1), idle("a", "b"), rng)
    assert first.reason == "cold" and first.cached_tokens == 0
    again = route(policy, request(1), idle("a", "b"), rng, now=1.0)
    assert again == Decision(first.replica, "prefix-hit", 4 * BLOCK, work_tokens=5)


def test_prefixaware_spreads_cold_prefixes_of_a_sequential_client() -> None:
    policy, rng = make_policy("prefixaware"), random.Random(0)
    placed = Counter(
        route(policy, request(p), idle("a", "b"), rng, now=p).replica for p in range(8)
    )
    assert placed == {"a": 4, "b": 4}


def test_load_outweighs_a_short_shared_prefix_instead_of_hot_spotting() -> None:
    policy, rng = cast(CostPolicy, make_policy("prefixaware")), random.Random(0)
    route(policy, request(7, blocks=1), idle("a", "b"), rng)
    cached_on = policy.speculative.replicas().pop()
    other = "b" if cached_on == "a" else "a"
    busy = [
        ReplicaView(cached_on, in_flight=1, queued_prefill_tokens=100),
        ReplicaView(other, in_flight=0, queued_prefill_tokens=0),
    ]
    assert policy.choose(request(7, blocks=1), busy, rng, 0.0) == Decision(
        other, "load", 0, 1 * BLOCK + 5
    )


def test_prefixonly_hot_spots_a_shared_prefix_whatever_the_load() -> None:
    policy, rng = make_policy("prefixonly"), random.Random(0)
    first = route(policy, request(7, blocks=1), idle("a", "b"), rng)
    busy = [
        ReplicaView(first.replica, in_flight=50, queued_prefill_tokens=10_000),
        ReplicaView("a" if first.replica == "b" else "b", 0, 0),
    ]
    assert policy.choose(request(7, blocks=1), busy, rng, 1.0).replica == first.replica


def test_equal_costs_break_ties_at_random_not_first_wins() -> None:
    picks = Counter(
        make_policy("prefixaware")
        .choose(request(1), idle("a", "b", "c"), random.Random(seed), 0.0)
        .replica
        for seed in range(60)
    )
    assert set(picks) == {"a", "b", "c"}


def test_kvaware_prefers_l0_over_l1_over_shared_l2() -> None:
    index = PrefixIndex()
    req = request(3)
    index.insert("a", req.hashes, Tier.L1, now=0.0)
    index.insert("b", req.hashes, Tier.L0, now=0.0)
    index.insert(SHARED, req.hashes, Tier.L2, now=0.0)
    policy = make_policy("kvaware", index=index)
    assert policy.choose(req, idle("a", "b", "c"), random.Random(0), 0.0) == Decision(
        "b", "prefix-hit", 4 * BLOCK, work_tokens=5
    )
    index.purge("b")
    assert policy.choose(req, idle("a", "b", "c"), random.Random(0), 0.0).replica == "a"


def test_kvaware_speculative_entries_expire_after_their_ttl() -> None:
    policy = make_policy("kvaware", speculative_ttl_s=5.0)
    rng = random.Random(0)
    first = route(policy, request(1), idle("a", "b"), rng, now=0.0)
    assert policy.choose(request(1), idle("a", "b"), rng, 1.0).replica == first.replica
    route(policy, request(2), idle("a", "b"), rng, now=10.0)  # expires the first entry
    assert policy.choose(request(1), idle("a", "b"), rng, 10.0).reason == "cold"


def test_forget_purges_a_restarted_replicas_entries() -> None:
    policy, rng = make_policy("prefixaware"), random.Random(0)
    first = route(policy, request(1), idle("a", "b"), rng)
    policy.forget(first.replica)
    assert policy.choose(request(1), idle("a", "b"), rng, 1.0).reason == "cold"


def test_unhealthy_replicas_are_never_chosen_even_when_they_hold_the_prefix() -> None:
    policy, rng = make_policy("prefixaware"), random.Random(0)
    first = route(policy, request(1), idle("a", "b"), rng)
    views = [ReplicaView(n, 0, 0, healthy=n != first.replica) for n in ("a", "b")]
    assert policy.choose(request(1), views, rng, 1.0).replica != first.replica


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_strategy_raises_routing_error_without_a_healthy_replica(name: str) -> None:
    views = [ReplicaView("a", 0, 0, healthy=False)]
    with pytest.raises(RoutingError):
        make_policy(name).choose(request(1), views, random.Random(0), 0.0)


def test_roundrobin_cycles_through_healthy_replicas_in_name_order() -> None:
    policy, rng = make_policy("roundrobin"), random.Random(0)
    assert [route(policy, request(1), idle("c", "a", "b"), rng).replica for _ in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]


def test_leastload_picks_fewest_in_flight_then_fewest_queued_tokens() -> None:
    views = [ReplicaView("a", 2, 0), ReplicaView("b", 1, 500), ReplicaView("c", 1, 100)]
    assert make_policy("leastload").choose(request(1), views, random.Random(0), 0.0) == Decision(
        "c", "load", 0
    )


def test_session_sticks_to_its_replica_and_repins_when_it_fails() -> None:
    policy, rng = make_policy("session"), random.Random(0)
    first = route(policy, request(1, session="u1"), idle("a", "b"), rng)
    loaded = [
        ReplicaView(first.replica, 9, 900),
        ReplicaView("a" if first.replica == "b" else "b", 0, 0),
    ]
    assert policy.choose(request(2, session="u1"), loaded, rng, 1.0) == Decision(
        first.replica, "session", 0
    )
    down = [
        ReplicaView(v.name, v.in_flight, v.queued_prefill_tokens, healthy=v.name != first.replica)
        for v in loaded
    ]
    assert policy.choose(request(2, session="u1"), down, rng, 2.0).replica != first.replica


def test_sessions_are_per_tenant() -> None:
    """Another tenant naming the same session neither joins it (learning from where it lands
    that it exists) nor re-pins it."""
    policy, rng = make_policy("session"), random.Random(0)
    alpha = route(policy, request(1, session="u1", tenant="alpha"), idle("a", "b"), rng)
    other = "a" if alpha.replica == "b" else "b"
    loaded = [ReplicaView(alpha.replica, 9, 900), ReplicaView(other, 0, 0)]
    for tenant in ("bravo", None):
        bravo = route(policy, request(2, session="u1", tenant=tenant), loaded, rng, 1.0)
        assert bravo == Decision(other, "load", 0)
    assert policy.choose(request(3, session="u1", tenant="alpha"), loaded, rng, 2.0) == Decision(
        alpha.replica, "session", 0
    )
    assert policy.choose(request(3, session="u1", tenant="bravo"), loaded, rng, 2.0) == Decision(
        other, "session", 0
    )


def test_unknown_strategy_or_option_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="nosuch"):
        make_policy("nosuch")
    with pytest.raises(ConfigError, match="roundrobin"):
        make_policy("roundrobin", bogus=1)
    with pytest.raises(ConfigError, match="l1_credit"):
        CostWeights(l1_credit=1.5)


def test_kvaware_keeps_a_shared_root_hot_in_a_full_index() -> None:
    """A cache hit sends no event: routing to a replica refreshes its matched prefix, so a
    system prompt stored once outlives the conversations' leaves stored after it."""
    index = PrefixIndex(max_blocks=12)
    policy, rng = make_policy("kvaware", index=index), random.Random(0)
    system = request(9, blocks=4)  # a 4-block system prompt every conversation starts with
    index.insert("a", system.hashes, Tier.L0, now=0.0)
    for turn in range(1, 20):
        tail = request(turn, blocks=2)
        req = system._replace(hashes=system.hashes + tail.hashes, prompt_tokens=6 * BLOCK + 5)
        decision = route(policy, req, idle("a"), rng, now=float(turn))
        assert decision.cached_tokens >= 4 * BLOCK, turn
        index.insert("a", req.hashes[4:], Tier.L0, now=turn + 0.5)  # the engine stores it
    assert index.match(system.hashes) == {"a": [Tier.L0] * 4}
