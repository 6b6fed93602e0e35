"""What a failure-path test checks was left behind: processes by id."""

from __future__ import annotations

import subprocess
import time


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie, exited but not reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stops_with_its_starter(starter: subprocess.Popen[str], child: int, within_s: float) -> bool:
    """SIGKILL `starter` (out of memory, say); whether its `child`, in a session of its own,
    then stops by itself within `within_s`."""
    starter.kill()
    starter.wait(10)
    deadline = time.monotonic() + within_s
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not running(child)
