"""Where a local fleet puts its engines and its connectors' background threads."""

import pytest

from kvtier.tools.cluster.local_fleet import LocalFleet
from kvtier.tools.cluster.spec import parse_spec


def fleet(cpus: int, monkeypatch: pytest.MonkeyPatch, **local: object) -> LocalFleet:
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    return LocalFleet(parse_spec({"replicas": 3, "kvtier": local}), progress=False)


def background_setting(f: LocalFleet) -> object:
    config = f.connector_config(0, "tcp://127.0.0.1:1")
    assert config is not None
    return config["kv_connector_extra_config"]["background_cpus"]


def test_with_no_free_core_background_threads_stay_on_their_own_engines_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = fleet(2, monkeypatch)
    assert [f.engine_cpus(i) for i in range(3)] == [[0], [1], [0]]
    assert background_setting(f) == "inherit"


def test_background_threads_take_the_cores_no_engine_is_bound_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = fleet(8, monkeypatch, threadsPerReplica=2)
    assert [f.engine_cpus(i) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert background_setting(f) == "6,7"


def test_an_explicit_background_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    f = fleet(2, monkeypatch, connector={"background_cpus": "1"})
    assert background_setting(f) == "1"
