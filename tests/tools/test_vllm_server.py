"""`kvtier.tools.vllm_server`: a server keeps its temporary files (vLLM's IPC sockets, its
torch.distributed init file) in a directory of its own, removed once it has stopped."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

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
