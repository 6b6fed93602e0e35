"""How a configuration name of `kvtier bench chat|trace|rag` becomes a fleet."""

from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tools.bench.fleet_runs import config_spec
from kvtier.tools.cluster.spec import FleetSpec


@pytest.mark.parametrize(
    ("name", "l0_events"),
    [
        ("kvtier-l1l2-kvaware", True),
        ("kvtier-l1l2-kvaware+no-l0-events", False),
        ("kvtier-l1l2-kvaware+no-l0-events+monitor", False),
    ],
)
def test_a_configuration_may_go_without_vllms_kv_events(
    tmp_path: Path, name: str, l0_events: bool
) -> None:
    spec = config_spec(FleetSpec(), name, tmp_path)
    assert spec.strategy == "kvaware"
    assert spec.local.vllm_kv_events is l0_events
    assert spec.local.work_dir == str(tmp_path / name)


def test_an_unknown_configuration_names_the_suffixes() -> None:
    with pytest.raises(ConfigError, match=r"'kvaware'.*\+no-l0-events and then \+monitor"):
        config_spec(FleetSpec(), "kvaware+no-l0-events", Path("/tmp"))
