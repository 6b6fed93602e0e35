"""`kvtier.tools.cluster.state`: `signal_owner` signals nothing, reporting the state file stale
or invalid, where its pid no longer names the `kvtier up` that wrote it."""

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.core.errors import KvtierError
from kvtier.tools.cluster.state import process_identity, signal_owner


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
