"""Where a local fleet puts its engines and its connectors' background threads; how it starts
and stops (with stand-in processes, no engine)."""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from kvtier.core.errors import KvtierError
from kvtier.net.ports import free_port, free_port_range
from kvtier.tools.cluster.local_fleet import STATE_FILE, LocalFleet
from kvtier.tools.cluster.spec import parse_spec
from kvtier.tools.cluster.state import RUNNING, check_leftovers, process_identity, read_state
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerProcess, ServerSpec


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


@pytest.mark.parametrize("taken", ["router", "replica 1"])
def test_start_fails_at_once_naming_a_taken_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: str
) -> None:
    router_port, base_port = free_port(), free_port_range(2)
    port = router_port if taken == "router" else base_port + 1
    local = {"routerPort": router_port, "replicaBasePort": base_port, "workDir": str(tmp_path)}
    f = LocalFleet(parse_spec({"replicas": 2, "kvtier": local}), progress=False)
    for step in ("_start_l2", "_start_replicas", "_start_router"):
        monkeypatch.setattr(f, step, lambda: pytest.fail("started with a port taken"))
    with socket.socket() as other:  # another server (another `kvtier up`) listening there
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(KvtierError, match=f"port {port} .* is taken"):
            f.start()


def rotation_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvtier-log-rotation"]


def test_logs_are_rotated_while_the_fleet_starts_and_no_more_once_it_failed_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = {"routerPort": free_port(), "replicaBasePort": free_port(), "workDir": str(tmp_path)}
    f = LocalFleet(parse_spec({"replicas": 1, "kvtier": {**local, "logMaxMiB": 1}}))
    rotating: list[int] = []

    def fail() -> None:  # the L2 does not start
        rotating.append(len(rotation_threads()))
        raise KvtierError("no L2")

    monkeypatch.setattr(f, "_start_l2", fail)
    with pytest.raises(KvtierError, match="no L2"):
        f.start()
    assert rotating == [1] and f._log_rotator.max_bytes == 1024**2
    assert not rotation_threads()


def test_stop_leaves_the_state_file_of_another_kvtier_up(tmp_path: Path) -> None:
    state = tmp_path / STATE_FILE
    other = subprocess.Popen(["sleep", "60"])  # the `kvtier up` running on this work directory
    try:
        state.write_text(json.dumps({"pid": other.pid, "identity": process_identity(other.pid)}))
        LocalFleet(parse_spec({"kvtier": {"workDir": str(tmp_path)}}), progress=False).stop()
    finally:
        other.kill()
        other.wait()
    assert state.exists()


def test_stop_keeps_the_state_file_while_a_server_it_records_runs(tmp_path: Path) -> None:
    """A server that did not stop (a Valkey server stuck, a mount daemon): the state file stays,
    for `kvtier down` to find and stop it."""
    fleet = LocalFleet(parse_spec({"kvtier": {"workDir": str(tmp_path)}}), progress=False)
    left = subprocess.Popen(["sleep", "60"])
    try:
        fleet._record_server("valkey server", left.pid)
        fleet.stop()
        assert [s.pid for s in read_state(tmp_path / STATE_FILE).servers] == [left.pid]
    finally:
        left.kill()
        left.wait()


def test_a_running_kvtier_up_that_takes_no_lock_is_not_overwritten(tmp_path: Path) -> None:
    """A `kvtier up` of an older version runs on the work directory without its lock: a new
    one must not take the directory over."""
    state = tmp_path / STATE_FILE
    other = subprocess.Popen(["sleep", "60"])
    try:
        state.write_text(json.dumps({"pid": other.pid, "identity": process_identity(other.pid)}))
        with pytest.raises(KvtierError, match=f"runs still \\(pid {other.pid}\\)"):
            check_leftovers(state)
    finally:
        other.kill()
        other.wait()


DRAINS_FOREVER = ["sh", "-c", "trap '' TERM; echo up; exec sleep 120"]
"""Stands for a server whose drain outlasts the test: it ignores SIGTERM."""


def test_a_ctrl_c_during_the_drain_kills_and_stops_everything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_spec({"replicas": 1, "kvtier": {"workDir": str(tmp_path)}})
    f = LocalFleet(spec, progress=False)
    f.router = subprocess.Popen(DRAINS_FOREVER, stdout=subprocess.PIPE, start_new_session=True)
    monkeypatch.setattr(ServerSpec, "command", lambda spec: DRAINS_FOREVER)
    log = tmp_path / "replica.log"
    replica = ServerProcess(ServerSpec(model="stand-in", port=1, log_path=log))
    f.replicas.append(replica)
    router, l2_closed = f.router, []
    f._stack.callback(l2_closed.append, True)  # stands for stopping Valkey, unmounting
    f._write_state(RUNNING)
    armed = [True]

    def ctrl_c(signum: int, frame: FrameType | None) -> None:
        if armed:  # once, and only while stop() runs
            armed.clear()
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, ctrl_c)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        assert router.stdout is not None and router.stdout.readline() == b"up\n"
        while b"up" not in log.read_bytes():
            time.sleep(0.05)
        began = time.monotonic()
        timer.start()  # the second Ctrl-C, a second into the router's drain
        with pytest.raises(KeyboardInterrupt):
            f.stop()
        assert time.monotonic() - began < 10  # killed, not waited for
        assert router.poll() is not None and not replica.alive()
        assert l2_closed and not (tmp_path / STATE_FILE).exists()
    finally:
        armed.clear()
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGKILL)
            router.wait()
        replica.kill()


def test_a_too_long_work_dir_for_the_event_sockets_is_named(tmp_path: Path) -> None:
    """The replicas' vLLM KV events go over Unix sockets in the work directory (vLLM binds only
    wildcard and ipc endpoints), whose paths are capped at 107 bytes."""
    work = tmp_path / ("w" * 100)
    spec = parse_spec({"kvtier": {"workDir": str(work), "vllmKvEvents": True}})
    with pytest.raises(KvtierError, match=r"kvtier.workDir: .* too long .*vllmKvEvents: false"):
        LocalFleet(spec, progress=False)._start_replicas()
