"""What a failure-path test checks was left behind: processes by id."""

from __future__ import annotations


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie, exited but not reaped, has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
