"""`kvtier.tools.cluster.state`: `signal_owner` signals nothing, reporting the state file stale
or invalid, where its pid no longer names the `kvtier up` that wrote it; the work directory's
lock is held by one process at a time, and goes with it."""

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import KvtierError
from kvtier.tools.cluster.state import WorkDirLock, process_identity, signal_owner


@pytest.fixture
def thread_id() -> Iterator[int]:
    """The id of a thread of this process (not its main thread): a pid the kernel handed out
    again after the `kvtier up` that had it exited, now naming a thread of another process."""
    started, done = threading.Event(), threading.Event()
    ids: list[int] = []

    def run() -> None:
        ids.append(threading.get_native_id())
        started.set()
        done.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert started.wait(10)
        yield ids[0]
    finally:
        done.set()
        thread.join(10)


@pytest.mark.usefixtures("no_signals")
def test_a_pid_now_naming_a_thread_is_stale(tmp_path: Path, thread_id: int) -> None:
    state = tmp_path / "cluster.json"
    state.write_text(json.dumps({"pid": thread_id, "identity": "another-boot/1"}))
    with pytest.raises(KvtierError, match="was stale.*signalled nothing"):
        signal_owner(state, signal.SIGTERM)
    assert not state.exists()


@pytest.mark.usefixtures("no_signals")
@pytest.mark.parametrize("pid", [2**31, 2**63], ids=repr)
def test_a_pid_out_of_range_is_invalid(tmp_path: Path, pid: int) -> None:
    state = tmp_path / "cluster.json"
    state.write_text(json.dumps({"pid": pid, "identity": process_identity(os.getpid())}))
    with pytest.raises(KvtierError, match="not a state file.*nothing was signalled"):
        signal_owner(state, signal.SIGTERM)
    assert state.exists()  # left for the user to remove


@pytest.mark.usefixtures("no_signals")
def test_a_recorded_mount_outside_the_work_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "cluster.json"
    owner = {"pid": os.getpid(), "identity": "another-boot/1"}  # stale
    state.write_text(json.dumps({**owner, "phase": "running", "mounts": ["/"]}))
    with pytest.raises(KvtierError, match="mounts outside its directory.*nothing was signalled"):
        signal_owner(state, signal.SIGTERM)
    assert state.exists()  # left for the user to remove


# holds the lock of the work directory argv[1] until killed
_HOLD = """
import sys, time
from pathlib import Path
from kvtier.tools.cluster.state import WorkDirLock
WorkDirLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_the_work_dir_lock_is_held_by_one_process_at_a_time_and_goes_with_it(
    tmp_path: Path,
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(KvtierError, match=f"{tmp_path} is in use .* \\(pid {holder.pid}\\)"):
            WorkDirLock(tmp_path).acquire()
    finally:
        holder.kill()  # the kernel drops its lock
        holder.wait()
    with WorkDirLock(tmp_path):
        with pytest.raises(KvtierError, match=f"in use .* \\(pid {os.getpid()}\\)"):
            WorkDirLock(tmp_path).acquire()  # in this process too
    with WorkDirLock(tmp_path):
        pass  # released
