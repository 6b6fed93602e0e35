"""Sweeps (curves as JSON + PNG) and capacity planning by bisection."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.tools.sim.cost_model import load_costs
from kvtier.tools.sim.plan import plan_capacity
from kvtier.tools.sim.plot import plot_sweep
from kvtier.tools.sim.simulator import FleetConfig
from kvtier.tools.sim.sweep import parse_capacity, parse_sweep, run_sweep
from kvtier.tools.sim.trace import Trace, load_trace
from tests.helpers.sim import MOONCAKE, reference_lru_hits

SINGLE_L1 = FleetConfig(replicas=1, l0_blocks=0, l1_blocks=0, l2_blocks=0, strategy="roundrobin")


@pytest.fixture(scope="module")
def subset() -> Trace:
    return load_trace(MOONCAKE, limit=1000)


def test_parse_sweep_reads_capacities_counts_and_names() -> None:
    assert parse_sweep("l1=0,1000,inf").values == (0.0, 1000.0, math.inf)
    assert parse_sweep("replicas=1,2").values == (1, 2)
    assert parse_sweep("strategy=kvaware,roundrobin").values == ("kvaware", "roundrobin")
    assert parse_capacity("INF") == math.inf
    with pytest.raises(ConfigError, match="NAME one of l0, l1, l2, replicas"):
        parse_sweep("l3=1")
    with pytest.raises(ConfigError, match="capacity: must be >= 0"):
        parse_sweep("l2=-5")


def test_capacity_sweep_gives_a_monotone_hit_rate_curve_and_a_png(
    subset: Trace, tmp_path: Path
) -> None:
    doc = run_sweep(subset, SINGLE_L1, load_costs(), [parse_sweep("l1=0,100,1000,inf")])
    assert doc["x"] == "l1" and doc["series"] is None
    points = doc["points"]
    assert [p["x"] for p in points] == [0, 100, 1000, "inf"]
    rates = [p["hit_rate"] for p in points]
    assert rates == sorted(rates) and rates[-1] == subset.ideal_hit_rate()
    png = tmp_path / "curve.png"
    plot_sweep(doc, png, title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_axes_give_one_series_per_value(subset: Trace, tmp_path: Path) -> None:
    base = FleetConfig(l0_blocks=30, l2_blocks=math.inf)
    doc = run_sweep(
        subset,
        base,
        load_costs(),
        [parse_sweep("replicas=1,4"), parse_sweep("strategy=kvaware,roundrobin")],
    )
    assert [(p["series"], p["x"]) for p in doc["points"]] == [
        ("kvaware", 1),
        ("kvaware", 4),
        ("roundrobin", 1),
        ("roundrobin", 4),
    ]
    plot_sweep(doc, tmp_path / "replicas.png")
    assert (tmp_path / "replicas.png").stat().st_size > 0


def test_plan_finds_the_smallest_l1_reaching_the_target(subset: Trace) -> None:
    total = subset.total_blocks()
    target = round(0.8 * subset.ideal_hit_rate(), 3)
    answer = plan_capacity(subset, SINGLE_L1, load_costs(), Tier.L1, target, tolerance=0.0)
    assert answer.reachable and answer.blocks is not None
    blocks = [r.blocks for r in subset]
    assert reference_lru_hits(blocks, answer.blocks) / total >= target
    assert reference_lru_hits(blocks, answer.blocks - 1) / total < target
    assert answer.bytes == answer.blocks * 512 * load_costs().kv_bytes_per_token
    assert answer.probes[0] == ("inf", subset.ideal_hit_rate())


def test_plan_reports_an_unreachable_target(subset: Trace) -> None:
    answer = plan_capacity(subset, SINGLE_L1, load_costs(), Tier.L1, 0.9)
    assert not answer.reachable and answer.blocks is None
    assert answer.hit_rate == subset.ideal_hit_rate()
    assert "out of reach" in answer.summary()


def test_plan_answers_zero_when_other_tiers_already_suffice(subset: Trace) -> None:
    base = FleetConfig(replicas=1, l0_blocks=math.inf, strategy="roundrobin")
    answer = plan_capacity(subset, base, load_costs(), Tier.L1, 0.1)
    assert answer.blocks == 0
