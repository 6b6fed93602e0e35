"""The fleet simulation: TTFT arithmetic, cache semantics, routing through the router's code."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.router.index import PrefixIndex
from kvtier.tools.sim.cost_model import load_costs
from kvtier.tools.sim.simulator import FleetConfig, _Fleet, simulate
from kvtier.tools.sim.trace import Trace, block_hash, load_trace
from tests.helpers.sim import MOONCAKE, make_costs, reference_lru_hits, write_trace

INF = math.inf


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load_trace(MOONCAKE)


# ----- TTFT = queueing + loads + prefill, on hand-sized traces -----


def test_a_queued_request_waits_then_prefills_only_its_uncached_tail(tmp_path: Path) -> None:
    # A computes blocks 1,2 (1 s); B arrives at 0.1 s, waits until 1.0 s, finds 1,2 in L0 and
    # prefills its third block (0.5 s): first token at 1.5 s.
    trace = load_trace(
        write_trace(tmp_path / "t.jsonl", [(0, 1024, 4, [1, 2]), (100, 1536, 4, [1, 2, 3])])
    )
    result = simulate(trace, FleetConfig(l0_blocks=INF, strategy="roundrobin"), make_costs())
    assert result.ttft_p50_ms == pytest.approx((1000 + 1400) / 2)
    assert result.ttft_mean_ms == pytest.approx(1200)
    assert result.queue_p99_ms == pytest.approx(0.99 * 900)
    assert result.hit_rate_by_tier == {"l0": 2 / 5, "l1": 0.0, "l2": 0.0}
    assert result.replicas[0].prefill_tokens == 1024 + 512


def test_an_l1_hit_costs_its_read_time(tmp_path: Path) -> None:
    # L0 keeps one block: after A it holds block 1 (the root: tail-first), L1 holds 1 and 2.
    # B reads block 1 from L0 (free), block 2 from L1 (0.25 s), prefills block 3 (0.5 s).
    trace = load_trace(
        write_trace(tmp_path / "t.jsonl", [(0, 1024, 4, [1, 2]), (2000, 1536, 4, [1, 2, 3])])
    )
    config = FleetConfig(l0_blocks=1, l1_blocks=INF, strategy="roundrobin")
    result = simulate(trace, config, make_costs())
    assert result.ttft_mean_ms == pytest.approx((1000 + 750) / 2)  # A 1.0 s, B 0.75 s
    assert result.hit_rate_by_tier == {"l0": 1 / 5, "l1": 1 / 5, "l2": 0.0}


def _l2_trace(tmp_path: Path) -> Trace:
    # A on r0 computes 1,2 and writes them to L2; at 2 s B (r1) and C (r2) both read them.
    return load_trace(
        write_trace(
            tmp_path / "t.jsonl",
            [(0, 1024, 4, [1, 2]), (2000, 1536, 4, [1, 2, 3]), (2000, 1536, 4, [1, 2, 4])],
        )
    )


def test_l2_reads_of_other_replicas_queue_for_the_shared_pool(tmp_path: Path) -> None:
    config = FleetConfig(replicas=3, l0_blocks=INF, l2_blocks=INF, strategy="roundrobin")
    # Each read of 1024 tokens takes 0.25 s at the reader and 0.25 s of the pool: B's read
    # ends at 2.25 s, C's waits for B's and ends at 2.5 s; both then prefill 0.5 s.
    result = simulate(_l2_trace(tmp_path), config, make_costs(l2_pool_read_bytes_per_s=4.096e6))
    assert sorted(round(r.busy_s, 6) for r in result.replicas) == [0.75, 1.0, 1.0]
    assert result.ttft_p50_ms == pytest.approx(1000)  # A 1.0, B 0.75, C 1.0
    assert result.ttft_mean_ms == pytest.approx((1000 + 750 + 1000) / 3)
    assert result.hit_rate_by_tier == {"l0": 0.0, "l1": 0.0, "l2": 4 / 8}


def test_a_tier_slower_than_recomputing_is_recomputed(tmp_path: Path) -> None:
    config = FleetConfig(replicas=3, l0_blocks=INF, l2_blocks=INF, strategy="roundrobin")
    result = simulate(_l2_trace(tmp_path), config, make_costs(l2_read_bytes_per_s=1.024e6))
    assert result.hit_rate == 0.0
    assert result.ttft_p50_ms == pytest.approx(1500)


# ----- cache semantics against independent computations -----


def test_one_replica_with_an_infinite_cache_hits_the_ideal_rate(mooncake: Trace) -> None:
    config = FleetConfig(replicas=1, l0_blocks=INF, strategy="roundrobin")
    result = simulate(mooncake, config, load_costs())
    assert result.hit_rate == mooncake.ideal_hit_rate()
    assert round(result.hit_rate, 3) == 0.366


@pytest.mark.parametrize("tier", ["l0", "l1", "l2"])
def test_a_single_lru_tier_matches_a_reference_lru_and_grows_with_capacity(
    mooncake: Trace, tier: str
) -> None:
    subset = Trace(mooncake.requests[:2000])
    base = FleetConfig(replicas=1, l0_blocks=0, l1_blocks=0, l2_blocks=0, strategy="roundrobin")
    rates = []
    for capacity in (0, 10, 100, 1000, 3000, INF):
        changes: dict[str, Any] = {f"{tier}_blocks": capacity}
        result = simulate(subset, replace(base, **changes), load_costs())
        expected = reference_lru_hits((r.blocks for r in subset), capacity)
        assert result.hit_rate == expected / subset.total_blocks()
        rates.append(result.hit_rate)
    assert rates == sorted(rates) and rates[0] == 0.0 < rates[2]
    assert rates[-1] == subset.ideal_hit_rate()


def test_a_chain_longer_than_l0_keeps_its_root_blocks(tmp_path: Path) -> None:
    # L0 holds 3 blocks; A writes 1..5: the root 1,2,3 stay (tail-first, as vLLM and kvtier's
    # L1 evict), so B, extending A, hits them.
    rows = [(0, 5 * 512, 1, [1, 2, 3, 4, 5]), (10_000, 6 * 512, 1, [1, 2, 3, 4, 5, 6])]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    config = FleetConfig(l0_blocks=3, strategy="roundrobin")
    fleet = _Fleet(trace, config, make_costs())
    fleet.run(progress=False)
    ((_, l0),) = fleet.replicas[0].tiers
    assert sorted(b for b in range(1, 7) if b in l0) == [1, 2, 3]
    assert fleet.hit_blocks[Tier.L0] == 3


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_the_index_keeps_blocks_stored_and_evicted_in_one_step(
    tmp_path: Path, eviction: str
) -> None:
    """A chain longer than L0 evicts blocks it (re-)admits in the same step: the index gets
    the net effect, so it names exactly the blocks L0 holds."""
    rows = [(0, 4 * 512, 1, [1, 2, 3, 4]), (10_000, 5 * 512, 1, [1, 2, 3, 4, 5])]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    config = FleetConfig(l0_blocks=3, l0_eviction=eviction, strategy="kvaware")
    fleet = _Fleet(trace, config, make_costs())
    fleet.run(progress=False)
    index = fleet.index
    assert isinstance(index, PrefixIndex)
    replica = fleet.replicas[0]
    ((_, l0),) = replica.tiers
    indexed = {b for b in range(1, 6) if index.match([block_hash(b)]).get(replica.name)}
    assert indexed == {b for b in range(1, 6) if b in l0} and len(indexed) == 3


# ----- routing through kvtier.router.policies -----


def test_pure_longest_prefix_routing_sends_the_trace_to_one_replica(mooncake: Trace) -> None:
    config = FleetConfig(
        replicas=16, l0_blocks=292, l1_blocks=2340, l2_blocks=0, strategy="prefixonly"
    )
    result = simulate(mooncake, config, load_costs())
    busiest = max(r.requests for r in result.replicas)
    assert busiest >= 0.99 * len(mooncake)
    assert result.load_max_over_mean > 15.8


def test_kvaware_with_shared_l2_balances_load_near_the_ideal_hit_rate(mooncake: Trace) -> None:
    config = FleetConfig(
        replicas=16, l0_blocks=292, l1_blocks=2340, l2_blocks=INF, strategy="kvaware"
    )
    result = simulate(mooncake, config, load_costs())
    assert result.load_max_over_mean <= 1.3
    assert result.hit_rate >= 0.9 * result.ideal_hit_rate


def test_the_kvaware_index_mirrors_the_simulated_tiers(mooncake: Trace) -> None:
    """Inserts and removals reach the index as KV events would: it matches what caches hold."""
    subset = Trace(mooncake.requests[:1500])
    config = FleetConfig(replicas=4, l0_blocks=20, l1_blocks=60, l2_blocks=400)
    fleet = _Fleet(subset, config, load_costs())
    fleet.run(progress=False)
    index = fleet.index
    assert isinstance(index, PrefixIndex)
    assert fleet.policy.index is index  # type: ignore[attr-defined]
    names = [r.name for r in fleet.replicas]
    for request in subset.requests[-300:]:
        expected: dict[str, list[Tier]] = {}
        for replica in fleet.replicas:
            tiers: list[Tier] = []
            for block in request.blocks:
                held = [tier for tier, cache in replica.tiers if block in cache]
                if not held:
                    break
                tiers.append(held[0])
            expected[replica.name] = tiers
        assert index.match(request.hashes, replicas=names) == expected


def test_a_run_is_deterministic_for_a_seed(mooncake: Trace) -> None:
    subset = Trace(mooncake.requests[:1000])
    config = FleetConfig(replicas=8, l0_blocks=50, l2_blocks=1000, seed=7)
    first, second = (simulate(subset, config, load_costs()).to_dict() for _ in range(2))
    for doc in (first, second):
        doc.pop("wall_s"), doc.pop("cpu_s")
    assert first == second


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"replicas": 0}, "replicas: must be positive"),
        ({"l1_blocks": -1}, "l1_blocks: must be a whole number"),
        ({"l2_eviction": "mru"}, "l2_eviction: unknown policy 'mru'"),
    ],
)
def test_invalid_fleet_settings_name_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FleetConfig(**changes)  # type: ignore[arg-type]


def test_unknown_strategy_and_options_are_config_errors(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, 512, 1, [1])]))
    with pytest.raises(ConfigError, match="unknown 'fastest'"):
        simulate(trace, FleetConfig(strategy="fastest"), make_costs())
    with pytest.raises(ConfigError, match="queue_weight do not apply to strategy roundrobin"):
        simulate(
            trace,
            FleetConfig(strategy="roundrobin", strategy_options={"queue_weight": 2.0}),
            make_costs(),
        )
