"""Where a local fleet puts its engines and its connectors' background threads."""

from pathlib import Path

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


def test_engines_that_outnumber_the_cores_are_left_unbound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = fleet(2, monkeypatch)
    assert [f.engine_cpus(i) for i in range(3)] == [None, None, None]
    assert background_setting(f) == "inherit"
    env = f.server_spec(0, "tcp://127.0.0.1:1").environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "1"


def test_with_no_free_core_background_threads_stay_on_their_own_engines_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = fleet(2, monkeypatch, replicas=2)
    assert [f.engine_cpus(i) for i in range(2)] == [[0], [1]]
    assert background_setting(f) == "inherit"
    bind = f.server_spec(1, "tcp://127.0.0.1:1").environment()["VLLM_CPU_OMP_THREADS_BIND"]
    assert bind == "1"


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


@pytest.mark.valkey
@pytest.mark.parametrize("persistent", [False, True])
def test_kvtier_up_again_finds_the_valkey_l2_it_left_only_when_persistent(
    tmp_path: Path, persistent: bool
) -> None:
    from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings
    from tests.helpers.l2 import IDENTITY, NAMESPACE, make_block

    l2 = {"l2CacheBackend": "valkey", "l2CacheSizeGiB": 0.1, "l2CachePersistent": persistent}
    spec = parse_spec({"kvCacheSpec": {"l2CacheSpec": l2}, "kvtier": {"workDir": str(tmp_path)}})
    block = make_block(8, 0, 64 * 1024)
    for run in range(2):  # `kvtier up`, `kvtier down`, `kvtier up`: the L2 step of each
        fleet = LocalFleet(spec, progress=False)
        try:
            fleet._start_l2()
            settings = ValkeyTierSettings(url=fleet.l2_locations[0])
            tier = ValkeyTier(settings, NAMESPACE, IDENTITY.manifest())
            if run == 0:
                assert tier.put(*block).stored
            else:
                assert (tier.get(block[0]) is not None) == persistent
            tier.close()
        finally:
            fleet.stop()
