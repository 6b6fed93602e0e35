"""`kvtier up` against `kvtier up`, `kvtier down` and `kvtier status` over its life: a second one
on the same work directory, a `kvtier down` while it starts, and the Valkey server, Prometheus
and JuiceFS mounts a killed one leaves running, which `kvtier down` stops.

`kvtier up` runs for real, in a process of its own, with its real L2 and Prometheus; only its
replicas and router are left out (no engine): they either start at once or never do."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.net.ports import free_port, free_port_range
from kvtier.tools.cluster.local_fleet import STATE_FILE, LocalFleet
from kvtier.tools.cluster.state import process_identity
from tests.helpers.l2 import needs_fuse, poll
from tests.helpers.procs import running

# `kvtier up --config FILE [FLAGS]` whose replicas start at once (argv[2] "running") or never
# ("starting": start-up stays under way), and which starts no router; with STAND_IN_VALKEY set,
# the Valkey server it starts is that binary
_UP = """
import os, sys, time
from kvtier.cli import main
from kvtier.tools.cluster.local_fleet import LocalFleet
from kvtier.tools.l2ops import valkey_server

if "STAND_IN_VALKEY" in os.environ:
    valkey_server.find_valkey_binary = lambda: os.environ["STAND_IN_VALKEY"]

def never_healthy(self):
    print("starting replicas", flush=True)
    while True:
        time.sleep(1)

LocalFleet._start_replicas = never_healthy if sys.argv[2] == "starting" else lambda self: None
LocalFleet._start_router = lambda self: None
sys.exit(main(["up", "--config", sys.argv[1], *sys.argv[3:]]))
"""
UP_TIMEOUT_S = 60


def write_config(path: Path, work_dir: Path, l2: str = "posix", replicas: int = 1) -> Path:
    """A deployment file: `replicas` on free ports, the L2 `l2` (posix, valkey or juicefs)."""
    kvtier = {
        "workDir": str(work_dir),
        "routerPort": free_port(),
        "replicaBasePort": free_port_range(replicas),
        "replicaDrainSeconds": 0,
        "router": {"drain_s": 0},
    }
    l2_spec = {"l2CacheBackend": l2, "l2CacheSizeGiB": 0.1}
    spec = {"replicas": replicas, "kvCacheSpec": {"l2CacheSpec": l2_spec}, "kvtier": kvtier}
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


@contextmanager
def kvtier_up(
    config: Path, phase: str, *flags: str, stand_in_valkey: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvtier up` with `config`, once its start-up is under way (`phase` "starting") or over
    ("running"); with `stand_in_valkey`, the Valkey server binary it starts, at once (the test
    follows that start-up itself). Killed at the end, with its process group (a Valkey server
    it started), if the test has not ended it."""
    env = {**os.environ, "STAND_IN_VALKEY": str(stand_in_valkey)} if stand_in_valkey else None
    up = subprocess.Popen(
        [sys.executable, "-c", _UP, str(config), phase, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        if stand_in_valkey is None:
            wait_for(up, "starting replicas" if phase == "starting" else "stops everything")
        yield up
    finally:
        if up.returncode is None:  # (unreaped: the group is still its own)
            os.killpg(up.pid, signal.SIGKILL)
        up.wait()


def wait_for(proc: subprocess.Popen[bytes], text: str) -> None:
    """Read `proc`'s output until `text`, for at most `UP_TIMEOUT_S`."""
    assert proc.stdout is not None
    out, deadline = b"", time.monotonic() + UP_TIMEOUT_S
    while text.encode() not in out:
        left = deadline - time.monotonic()
        assert left > 0, out.decode()
        if select.select([proc.stdout], [], [], left)[0]:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, out.decode()  # it exited
            out += chunk


def recorded(work_dir: Path) -> dict[str, object]:
    state: dict[str, object] = json.loads((work_dir / STATE_FILE).read_text())
    return state


def recorded_running(server: dict[str, object]) -> bool:
    """Whether the recorded server runs still (not gone, nor a zombie)."""
    pid = int(str(server["pid"]))
    return process_identity(pid) == server["identity"] and running(pid)


def mounted(point: str) -> bool:
    with open("/proc/mounts") as mounts:
        return any(line.split()[1] == point for line in mounts)


@pytest.fixture
def leftovers(tmp_path: Path) -> Iterator[list[dict[str, object]]]:
    """The servers of a `kvtier up` the test kills: whatever of them still runs once the test
    ends is killed, and every mount under `tmp_path` detached."""
    servers: list[dict[str, object]] = []
    yield servers
    from kvtier.tools.l2ops.juicefs import force_unmount, mounted_under

    for point in mounted_under(str(tmp_path)):
        force_unmount(point)
    for server in servers:
        try:
            pidfd = os.pidfd_open(int(str(server["pid"])))
        except ProcessLookupError:
            continue
        if process_identity(int(str(server["pid"]))) == server["identity"]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        os.close(pidfd)


def up_again(config: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """`kvtier up` in this process, failing the test should it start anything."""
    for step in ("_start_l2", "_start_replicas", "_start_router"):
        monkeypatch.setattr(LocalFleet, step, lambda self: pytest.fail("started"))
    return main(["up", "--config", str(config)])


def test_a_second_kvtier_up_on_the_work_dir_fails_at_once_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    with kvtier_up(write_config(tmp_path / "a.yaml", work), "running") as first:
        before = {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()}
        # other ports: only the work directory is shared
        assert up_again(write_config(tmp_path / "b.yaml", work), monkeypatch) == 2
        err = capsys.readouterr().err
        assert f"work directory {work} is in use by another `kvtier up` (pid {first.pid})" in err
        assert {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()} == before
        assert main(["down", "--config", str(tmp_path / "a.yaml")]) == 0
        assert first.wait(UP_TIMEOUT_S) == 0


@pytest.mark.valkey
def test_down_stops_a_kvtier_up_still_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], leftovers: list[dict[str, object]]
) -> None:
    config = write_config(tmp_path / "fleet.yaml", tmp_path / "work", l2="valkey")
    with kvtier_up(config, "starting") as up:
        state = recorded(tmp_path / "work")
        assert state["phase"] == "starting" and state["pid"] == up.pid and "router" not in state
        leftovers += state["servers"]  # type: ignore[arg-type]
        assert [s["name"] for s in leftovers] == ["valkey server"]
        assert recorded_running(leftovers[0])
        assert main(["status", "--config", str(config)]) == 2
        assert f"is starting (`kvtier up`, pid {up.pid})" in capsys.readouterr().err
        assert main(["down", "--config", str(config)]) == 0
        assert up.wait(UP_TIMEOUT_S) == 0
        assert not recorded_running(leftovers[0]) and not (tmp_path / "work" / STATE_FILE).exists()


# a Valkey server that never answers, as one still starting; writes its pid to the file beside it
_VALKEY_STARTING = '#!/bin/sh\necho $$ > "$0.tmp" && mv "$0.tmp" "$0.pid" && exec sleep 120\n'


def test_down_after_a_kvtier_up_killed_while_a_server_starts_stops_that_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], leftovers: list[dict[str, object]]
) -> None:
    stand_in, work = tmp_path / "valkey-server", tmp_path / "work"
    stand_in.write_text(_VALKEY_STARTING)
    stand_in.chmod(0o755)
    pid_file = tmp_path / "valkey-server.pid"
    config = write_config(tmp_path / "fleet.yaml", work, l2="valkey")
    with kvtier_up(config, "running", stand_in_valkey=stand_in) as up:
        assert poll(pid_file.exists, UP_TIMEOUT_S), "the Valkey server to start"
        pid = int(pid_file.read_text())
        leftovers.append({"pid": pid, "identity": process_identity(pid)})
        # (well within the 15 s in which `kvtier up` expects a Valkey server to answer)
        assert poll(lambda: recorded(work)["servers"], 5), "the starting server to be recorded"
        up.kill()
        up.wait()
    assert recorded(work)["servers"] == [{"name": "valkey server", **leftovers[0]}]
    assert main(["down", "--config", str(config)]) == 2
    assert f"no longer runs; stopped valkey server (pid {pid})" in capsys.readouterr().err
    assert not recorded_running(leftovers[0]) and not (work / STATE_FILE).exists()


def dead_owner() -> tuple[int, str | None]:
    """The pid and identity of a `kvtier up` since killed: a process started, ended (its input
    closed: no signal) and reaped."""
    owner = subprocess.Popen(["sh", "-c", "read line"], stdin=subprocess.PIPE)
    identity = process_identity(owner.pid)
    owner.communicate(timeout=10)
    return owner.pid, identity


@pytest.fixture(params=["reaped", "unreaped"])
def killed_owner(request: pytest.FixtureRequest) -> Iterator[tuple[int, str | None]]:
    """The pid and identity of a `kvtier up` since killed: reaped (`dead_owner`), or exited but
    not yet reaped by its parent (a zombie, until the test ends)."""
    if request.param == "reaped":
        yield dead_owner()
        return
    owner = subprocess.Popen(["true"])
    try:
        assert poll(lambda: not running(owner.pid), UP_TIMEOUT_S), "the owner to exit"
        yield owner.pid, process_identity(owner.pid)
    finally:
        owner.wait()


def test_status_of_a_kvtier_up_killed_while_starting_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], killed_owner: tuple[int, str | None]
) -> None:
    pid, identity = killed_owner
    state = tmp_path / STATE_FILE
    state.write_text(json.dumps({"pid": pid, "identity": identity, "phase": "starting"}))
    assert main(["status", "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert f"(pid {pid}) killed while starting: `kvtier down`" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("l2", "flags", "name"),
    [
        pytest.param("valkey", (), "valkey server", marks=pytest.mark.valkey),
        pytest.param(
            "posix",
            ("--monitor",),
            "prometheus",
            marks=pytest.mark.skipif(not shutil.which("prometheus"), reason="no prometheus"),
        ),
    ],
)
def test_down_after_a_killed_kvtier_up_stops_what_it_left_running(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    leftovers: list[dict[str, object]],
    l2: str,
    flags: tuple[str, ...],
    name: str,
) -> None:
    config = write_config(tmp_path / "fleet.yaml", tmp_path / "work", l2=l2)
    with kvtier_up(config, "running", *flags) as up:
        up.kill()
        up.wait()
    leftovers += recorded(tmp_path / "work")["servers"]  # type: ignore[arg-type]
    assert [s["name"] for s in leftovers] == [name] and recorded_running(leftovers[0])
    assert up_again(config, monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"`kvtier up` (pid {up.pid}) that was killed" in err and "Run `kvtier down`" in err
    assert main(["down", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"(pid {up.pid}) no longer runs; stopped {name} (pid {leftovers[0]['pid']})" in err
    assert not recorded_running(leftovers[0]) and not (tmp_path / "work" / STATE_FILE).exists()


@pytest.mark.juicefs
@needs_fuse
def test_down_after_a_killed_kvtier_up_unmounts_its_juicefs_mounts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], leftovers: list[dict[str, object]]
) -> None:
    from kvtier.tools.l2ops.juicefs import fd_comm_socket

    config = write_config(tmp_path / "fleet.yaml", tmp_path / "work", l2="juicefs", replicas=2)
    with kvtier_up(config, "running") as up:
        up.kill()
        up.wait()
    state = recorded(tmp_path / "work")
    leftovers += state["servers"]  # type: ignore[arg-type]
    mounts = state["mounts"]
    assert isinstance(mounts, list) and len(mounts) == 2 and all(map(mounted, mounts))
    assert [s["name"] for s in leftovers] == ["juicefs mount"] * 2
    assert all(map(recorded_running, leftovers))
    assert main(["down", "--config", str(config)]) == 2
    assert f"no longer runs; unmounted {', '.join(mounts)}" in capsys.readouterr().err
    assert not any(map(mounted, mounts)) and not any(map(recorded_running, leftovers))
    assert not any(Path(fd_comm_socket(int(str(s["pid"])))).exists() for s in leftovers)


def pid_of(pidfd: int) -> int:
    """The pid of the process `pidfd` refers to."""
    info = Path(f"/proc/self/fdinfo/{pidfd}").read_text()
    return int(next(line for line in info.splitlines() if line.startswith("Pid:")).split()[1])


def test_down_after_a_killed_kvtier_up_never_signals_a_pid_now_naming_another_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path / "fleet.yaml", tmp_path)
    left = subprocess.Popen(["sleep", "60"])  # a server the killed `kvtier up` left running
    other = subprocess.Popen(["sleep", "60"])  # has the pid of one it started, since gone
    pid, identity = dead_owner()
    servers = [
        {"name": "valkey server", "pid": left.pid, "identity": process_identity(left.pid)},
        {"name": "prometheus", "pid": other.pid, "identity": "another-boot/1"},
    ]
    state = {"pid": pid, "identity": identity, "phase": "running", "servers": servers}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    send = signal.pidfd_send_signal

    def only_left(pidfd: int, sig: int, *args: object) -> None:
        assert pid_of(pidfd) == left.pid, f"signalled {pid_of(pidfd)}"
        send(pidfd, sig)

    monkeypatch.setattr(signal, "pidfd_send_signal", only_left)
    for name in ("kill", "killpg"):
        monkeypatch.setattr(os, name, lambda *args: pytest.fail(f"signalled {args}"))
    try:
        assert main(["down", "--config", str(config)]) == 2
        assert left.wait(10) == -signal.SIGTERM and other.poll() is None
    finally:
        monkeypatch.undo()  # signals allowed again, to end what the test started
        for proc in (left, other):
            proc.kill()
            proc.wait()
    err = capsys.readouterr().err
    assert f"stopped valkey server (pid {left.pid})" in err and "prometheus" not in err


@pytest.mark.usefixtures("no_signals")
@pytest.mark.parametrize("server_pid", [0, 1], ids=repr)
def test_down_refuses_a_state_file_recording_pid_0_or_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], server_pid: int
) -> None:
    config = write_config(tmp_path / "fleet.yaml", tmp_path)
    pid, identity = dead_owner()
    server = {"name": "valkey server", "pid": server_pid, "identity": process_identity(1)}
    state = {"pid": pid, "identity": identity, "phase": "running", "servers": [server]}
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    assert main(["down", "--config", str(config)]) == 2
    assert "nothing was signalled" in capsys.readouterr().err
    assert (tmp_path / STATE_FILE).exists()  # left for the user to remove
