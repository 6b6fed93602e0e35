"""The state file `kvtier up` keeps in its work directory while it runs (`cluster.json`): the
fleet's URLs for `kvtier status`, and which process owns the fleet, for `kvtier down`.

A pid names a process only while that process lives: once `kvtier up` is gone without removing
the file (SIGKILL, out of memory, a reboot), the pid may be any other process's, init's
included. So the file also records the owner's identity (`process_identity`), and a process is
taken for the owner, and signalled, only while its pid and identity both match.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from kvtier.core.errors import KvtierError

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_NOT_A_PROCESS = {errno.ESRCH, errno.ENOENT, errno.EINVAL}
"""`pidfd_open` errors of a pid that names no process: none runs, or the pid now names a thread
of another process (ENOENT; EINVAL before Linux 6.9)."""


def process_identity(pid: int) -> str | None:
    """`BOOT_ID/START_TIME` of process `pid` (None: no such process). Unlike a pid, which the
    kernel reuses, the pair names one process for ever."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot_id = _BOOT_ID.read_text().strip()
    except OSError:
        return None
    # the start time is field 22; field 2, the command name in parentheses, may hold anything
    return f"{boot_id}/{stat.rpartition(')')[2].split()[19]}"


def write_state(path: Path, fleet: Mapping[str, object]) -> None:
    """Write `fleet`'s fields to `path`, naming this process as the owner. Atomic: a reader
    finds the previous file or the whole new one."""
    owner = {"pid": os.getpid(), "identity": process_identity(os.getpid())}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({**owner, **fleet}, indent=2))
    partial.replace(path)


def names_this_process(path: Path) -> bool:
    """Whether `path` is a state file written by this process."""
    try:
        owner = _read_owner(path)
    except KvtierError:
        return False
    return owner == (os.getpid(), process_identity(os.getpid()))


def signal_owner(path: Path, sig: signal.Signals) -> int:
    """Send `sig` to the running `kvtier up` that wrote `path` and return its pid.

    Signals nothing, raising `KvtierError`, when `path` is missing, unreadable or malformed,
    names pid 0 or 1 or no valid pid, or is stale: its owner is gone, its pid names no process
    or another one, a thread included (the file is then removed)."""
    pid, identity = _read_owner(path)
    try:
        # a pidfd keeps naming the process it was opened on, even if the pid is reused
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno not in _NOT_A_PROCESS:
            raise
        raise _remove_stale(path, pid) from None
    try:
        if process_identity(pid) != identity:
            raise _remove_stale(path, pid)
        signal.pidfd_send_signal(pidfd, sig)
    except PermissionError as exc:
        raise KvtierError(
            f"not permitted to signal the `kvtier up` of {path} (pid {pid}): "
            "run `kvtier down` as the user who ran `kvtier up`"
        ) from exc
    finally:
        os.close(pidfd)
    return pid


def _read_owner(path: Path) -> tuple[int, str]:
    """The owner's pid and identity recorded in `path` (`KvtierError` when none is)."""
    try:
        state = json.loads(path.read_text())
        pid, identity = state["pid"], state["identity"]
    except FileNotFoundError:
        raise KvtierError(f"no running cluster recorded in {path}") from None
    except OSError as exc:
        raise KvtierError(f"cannot read {path}: {exc}") from exc
    except (ValueError, LookupError, TypeError) as exc:
        raise _invalid(path, f"malformed: {exc!r}") from exc
    if type(pid) is not int or not 1 < pid < 2**31 or not isinstance(identity, str):
        raise _invalid(path, f"no valid owner (pid {pid!r}, identity {identity!r})")
    return pid, identity


def _invalid(path: Path, why: str) -> KvtierError:
    return KvtierError(
        f"{path} is not a state file of a running `kvtier up` ({why}); nothing was signalled. "
        "Stop that `kvtier up` with Ctrl-C if one runs, else remove the file"
    )


def _remove_stale(path: Path, pid: int) -> KvtierError:
    path.unlink(missing_ok=True)
    return KvtierError(
        f"{path} was stale: the `kvtier up` that wrote it (pid {pid}) no longer runs; removed "
        "it, signalled nothing. If that `kvtier up` was killed, its replicas and router stop "
        "themselves; a Valkey server, mounts or Prometheus it started may still run (see its "
        "logs/)"
    )
