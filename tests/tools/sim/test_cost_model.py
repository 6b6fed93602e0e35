"""Cost profiles: the bundled file, overrides, and the derived times and capacities."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier
from kvtier.tools.sim.cost_model import load_costs, profile_names
from tests.helpers.sim import make_costs


def test_bundled_profiles_load_and_the_default_is_gpu_7b() -> None:
    assert profile_names() == ["cpu-smollm2", "gpu-7b"]
    assert load_costs() == load_costs("gpu-7b")
    cpu = load_costs("cpu-smollm2")
    assert cpu.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2  # SmolLM2-135M, bf16
    assert cpu.prefill_tokens_per_s == 1190


def test_every_bundled_number_names_its_source() -> None:
    from importlib import resources

    doc = json.loads(resources.files("kvtier.tools.sim").joinpath("costs.json").read_text())
    for profile in doc["profiles"].values():
        for key in asdict(load_costs("gpu-7b")):
            assert profile[key]["source"].strip()


def test_overrides_replace_single_fields_and_unknown_fields_fail() -> None:
    costs = load_costs("cpu-smollm2", {"prefill_tokens_per_s": 2000})
    assert costs.prefill_tokens_per_s == 2000
    assert costs.prefill_s(1000) == 0.5
    with pytest.raises(ConfigError, match="unknown field 'speed'"):
        load_costs(None, {"speed": 1})


def test_a_profile_file_of_the_same_shape_uses_its_default(tmp_path: Path) -> None:
    mine = {k: {"value": v, "source": "test"} for k, v in asdict(load_costs("gpu-7b")).items()}
    mine["prefill_tokens_per_s"]["value"] = 42
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"default": "x", "profiles": {"x": mine}}))
    assert load_costs(str(path)).prefill_tokens_per_s == 42


def test_unknown_profile_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="cpu-smollm2, gpu-7b"):
        load_costs("tpu")


def test_read_times_per_tier_and_the_recompute_rule() -> None:
    costs = make_costs(l2_pool_read_bytes_per_s=8.192e6)
    assert costs.prefill_s(512) == 0.5
    assert costs.read_s(Tier.L0, 512) == 0.0
    assert costs.read_s(Tier.L1, 512) == 0.25
    assert costs.read_s(Tier.L2, 512) == 0.125
    assert costs.pool_s(512) == 0.0625
    assert costs.worth_loading(Tier.L2)
    assert not make_costs(l2_read_bytes_per_s=1.024e6).worth_loading(Tier.L2)  # as slow


def test_default_capacities_in_blocks() -> None:
    costs = make_costs(kv_bytes_per_token=1024)
    assert costs.default_blocks(Tier.L0, 512) == 2048
    assert costs.default_blocks(Tier.L2, 512) == 0


def test_invalid_numbers_name_the_field() -> None:
    with pytest.raises(ConfigError, match="prefill_tokens_per_s: must be positive"):
        make_costs(prefill_tokens_per_s=0)
    with pytest.raises(ConfigError, match="request_overhead_s: must be >= 0"):
        make_costs(request_overhead_s=-1)


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.5])
def test_kv_bytes_per_token_must_be_a_whole_number(value: float) -> None:
    with pytest.raises(
        ConfigError, match=f"kv_bytes_per_token: must be a whole number, got {value}"
    ):
        load_costs(None, {"kv_bytes_per_token": value})


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"default": "a", "profiles": {"a": [1]}}, "profile 'a' is not an object"),
        ({"profiles": {"a": {}}}, "names no 'default' profile"),
    ],
)
def test_a_profile_file_of_another_shape_is_named(
    tmp_path: Path, doc: dict[str, object], message: str
) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=message):
        load_costs(str(path))
