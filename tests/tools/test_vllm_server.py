"""`kvtier.tools.vllm_server`: a server keeps its temporary files (vLLM's IPC sockets, its
torch.distributed init file) in a directory of its own, removed once it has stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import KvtierError
from kvtier.net.ports import free_port
from kvtier.tools.vllm_server import (
    SHARED_MACHINE_WAIT,
    ServerProcess,
    ServerSpec,
    start_server,
)


@pytest.fixture
def system_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty system temporary directory for this test and the processes it starts (short:
    a socket's path has at most 107 bytes; `tmp_path` is made before, elsewhere)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    try:
        yield path
    finally:
        shutil.rmtree(path)


def spec(model: str, tmp_path: Path) -> ServerSpec:
    return ServerSpec(
        model=model,
        port=free_port(),
        max_model_len=2048,
        queue_wait=SHARED_MACHINE_WAIT,
        log_path=tmp_path / "server.log",
    )


def bound_unix_sockets(group: int) -> set[str]:
    """Paths of the unix sockets the processes of process group `group` have bound."""
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != group:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        except OSError:
            continue  # exited meanwhile
    with open("/proc/net/unix") as table:
        rows = [line.split() for line in table.read().splitlines()[1:]]
    return {row[7] for row in rows if len(row) > 7 and row[6] in inodes}


def test_the_user_s_own_rpc_directory_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    env = spec("/m", Path("/logs")).environment("/tmp/kvtier-vllm-x")
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == "/tmp/kvtier-vllm-x"
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/mine")
    env = spec("/m", Path("/logs")).environment("/tmp/kvtier-vllm-x")
    assert (env["TMPDIR"], env["VLLM_RPC_BASE_PATH"]) == ("/tmp/kvtier-vllm-x", "/run/mine")


def test_a_server_that_cannot_start_leaves_no_directory(
    system_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_exec(*args: object, **kwargs: object) -> None:
        raise OSError("exec failed")

    monkeypatch.setattr(subprocess, "Popen", no_exec)
    with pytest.raises(OSError, match="exec failed"):
        ServerProcess(spec("/m", tmp_path))
    assert list(system_tmp.iterdir()) == []


def test_a_temporary_directory_too_deep_for_sockets_gives_way_to_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    started: dict[str, dict[str, str]] = {}

    class Started:
        def __init__(self, cmd: object, *, env: dict[str, str], **kwargs: object) -> None:
            started["env"] = env

    monkeypatch.setattr(subprocess, "Popen", Started)
    server = ServerProcess(spec("/m", tmp_path))  # never stopped: no process to signal
    try:
        assert Path(server.temp_dir).parent == Path("/tmp") and list(deep.iterdir()) == []
        assert started["env"]["VLLM_RPC_BASE_PATH"] == server.temp_dir
    finally:
        shutil.rmtree(server.temp_dir)


@pytest.mark.engine
def test_an_engine_s_sockets_stay_in_its_own_directory_removed_when_it_stops(
    model_dir: str, tmp_path: Path, system_tmp: Path
) -> None:
    server = start_server(spec(model_dir, tmp_path), timeout_s=600)
    try:
        entries = list(system_tmp.iterdir())
        assert [e.name for e in entries if not e.is_dir()] == []  # no socket, no file
        assert len(entries) == 1  # the server's own directory
        sockets = bound_unix_sockets(server.pid)
        assert sockets  # vLLM's ZMQ IPC sockets, all in that directory
        assert {Path(s).parent for s in sockets} == {entries[0]}
    finally:
        server.stop()
    assert list(system_tmp.iterdir()) == []


def script_spec(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drain_s: int = 0
) -> ServerSpec:
    """A server whose command is a small Python script in place of vLLM (real processes, fast)."""
    monkeypatch.setattr(ServerSpec, "command", lambda self: [sys.executable, "-c", script])
    return ServerSpec(model="/m", port=free_port(), drain_s=drain_s, log_path=tmp_path / "s.log")


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_taken_port_is_named_before_anything_starts(system_tmp: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server_spec = dataclasses.replace(spec("/m", tmp_path), port=port)
        with pytest.raises(KvtierError, match=f"port {port} is taken"):
            ServerProcess(server_spec).kill()  # (without the check: stopped again at once)
    assert list(system_tmp.iterdir()) == []  # nothing started, no directory left


def test_a_server_that_dies_starting_shows_its_log_s_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "import sys; print('OSError: no model at /m'); sys.exit(3)"
    died = script_spec(script, tmp_path, monkeypatch)
    server = ServerProcess(died)
    with pytest.raises(KvtierError, match="(?s)exited with code 3.*OSError: no model at /m"):
        server.wait_healthy(timeout_s=30)


def test_a_stopped_server_s_group_is_never_signalled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ServerProcess(script_spec("import time; time.sleep(120)", tmp_path, monkeypatch))
    try:
        server.kill()  # a failed start
        assert not server.alive()
    finally:
        if server.alive():
            server.kill()
    # its pid is free: it may now lead another's process group (a shell's job, another server)
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda *args: signalled.append(args))
    server.stop()  # as LocalFleet.stop() then does, once the other replicas have drained
    server.kill()
    assert signalled == []


# the server ignores SIGTERM; its child (as vLLM's engine core) stays in its process group
_STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(child.pid, flush=True); time.sleep(120)"
)


def test_a_second_ctrl_c_during_stop_still_stops_the_whole_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = ServerProcess(script_spec(_STUBBORN, tmp_path, monkeypatch, drain_s=30))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "s.log").read_text().strip():
            assert time.monotonic() < deadline, "the test's server did not start"
            time.sleep(0.05)
        child = int((tmp_path / "s.log").read_text().split()[0])

        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)  # a Ctrl-C while stop() waits
            with pytest.raises(KeyboardInterrupt):
                server.stop()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert not server.alive()
        deadline = time.monotonic() + 10
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child)
    finally:
        server.kill()


# `kvtier serve` or `kvtier up` as the kernel leaves it when killed (SIGKILL, out of memory, its
# terminal closed): it starts a server, then dies without stopping it
_DYING_PARENT = """
import sys, time
from pathlib import Path
from kvtier.tools import vllm_server
vllm_server.STOP_GRACE_S = 1.0
vllm_server.ServerSpec.command = lambda self: [sys.executable, "-c", sys.argv[1]]
spec = vllm_server.ServerSpec(model="/m", port=int(sys.argv[2]), log_path=Path(sys.argv[3]))
server = vllm_server.ServerProcess(spec)
print(server.pid, server.temp_dir, flush=True)
time.sleep(120)
"""
# as vLLM's API server: SIGTERM stops its engine core (a child in its process group) and exits
_ORDERLY = (
    "import signal, subprocess, sys, time; from kvtier.core.parent_watch import stop_with_parent; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "signal.signal(signal.SIGTERM, lambda *_: (child.kill(), child.wait(), sys.exit(0))); "
    "stop_with_parent(); print(child.pid, flush=True); time.sleep(120)"
)
# a server stuck in its shutdown: its group is killed after the grace
_STUCK = _STUBBORN.replace(
    "print(", "import kvtier.core.parent_watch as k; k.stop_with_parent(); print("
)


@pytest.mark.parametrize("server", [_ORDERLY, _STUCK], ids=["orderly", "stuck"])
def test_a_server_stops_when_the_process_that_started_it_dies(server: str, tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", _DYING_PARENT, server, str(free_port()), str(log)],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        server_pid, temp_dir = parent.stdout.readline().split()
        pids.append(int(server_pid))  # the server
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text().strip()):
            assert time.monotonic() < deadline, "the test's server did not start"
            time.sleep(0.05)
        pids.append(int(log.read_text().split()[0]))  # its child
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not all(map(gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if not gone(pid)] == []
        assert not os.path.exists(temp_dir)  # its starter would have removed it
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:  # only if still the test's own process (its command names time.sleep)
            with contextlib.suppress(OSError):
                if b"time.sleep(120)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
