"""Where a local fleet puts its engines and its connectors' background threads."""

import pytest

from kvtier.tools.cluster.local_fleet import LocalFleet
from kvtier.tools.cluster.spec import parse_spec
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT


def fleet(
    cpus: int, monkeypatch: pytest.MonkeyPatch, replicas: int = 3, **local: object
) -> LocalFleet:
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    return LocalFleet(parse_spec({"replicas": replicas, "kvtier": local}), progress=False)


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


def test_engines_sleep_between_messages_only_where_they_share_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert fleet(2, monkeypatch).queue_wait() == SHARED_MACHINE_WAIT
    assert fleet(8, monkeypatch, threadsPerReplica=3).queue_wait() == SHARED_MACHINE_WAIT
    assert fleet(2, monkeypatch, replicas=2).queue_wait() is None
    assert fleet(8, monkeypatch, threadsPerReplica=2).queue_wait() is None
