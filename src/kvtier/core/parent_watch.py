"""Stop with the starter: a server process started in a session of its own (out of reach of the
terminal's signals) that its starter was to stop, and the starter died first (SIGKILL, out of
memory, its terminal closed), stops itself instead of running on, holding its port and memory.

The starter sets `STOP_WITH_PARENT_ENV` to `PID GRACE_S [DIR]` in the child's environment; the
child calls `stop_with_parent()` early (`kvtier.vllm.launch.main`, `kvtier router`). DIR, if
given, is a temporary directory the starter would have removed after the child stopped: an
orphan removes it itself.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import MutableMapping

__all__ = ["STOP_WITH_PARENT_ENV", "stop_with_parent"]

STOP_WITH_PARENT_ENV = "KVTIER_STOP_WITH_PARENT"
"""`PID GRACE_S [DIR]`: the process stops once its parent, process PID, has exited (and removes
DIR)."""


def stop_with_parent(env: MutableMapping[str, str] = os.environ) -> None:
    """With `KVTIER_STOP_WITH_PARENT="PID GRACE_S [DIR]"` in `env` (removed from it), watch from a
    daemon thread for the exit of this process's parent PID: then send this process SIGTERM
    (it stops in order: vLLM's API server stops its engine, the router drains), and GRACE_S
    later SIGKILL to this process's group if it leads one (as its starter starts it), else to
    this process; DIR is removed as this process exits, or before that SIGKILL. A parent
    already gone counts at once. Signals nothing but this process and its own group."""
    value = env.pop(STOP_WITH_PARENT_ENV, None)
    if value is None:
        return
    pid, grace_s, *temp_dir = value.split(" ", 2)
    watch = threading.Thread(
        target=_stop_when_orphaned,
        args=(int(pid), float(grace_s), temp_dir[0] if temp_dir else None),
        name="kvtier-stop-with-parent",
        daemon=True,
    )
    watch.start()


def _stop_when_orphaned(parent: int, grace_s: float, temp_dir: str | None) -> None:
    while os.getppid() == parent:  # an orphan is adopted: its parent pid changes
        time.sleep(0.5)
    # (to stderr, the process's log: vLLM's logging setup silences loggers made before it)
    print(
        f"kvtier: the process that started this one (pid {parent}) exited; stopping",
        file=sys.stderr,
        flush=True,
    )
    if temp_dir is not None:
        atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    if temp_dir is not None:
        shutil.rmtree(temp_dir, ignore_errors=True)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
