"""The state file `kvtier up` keeps in its work directory while it runs (`cluster.json`), and
the lock it holds on that directory (`.lock`).

The state file is written as start-up begins (`phase` "starting", no URLs yet), again as each
server that would outlive a killed `kvtier up` starts (`servers`: a Valkey server, Prometheus,
JuiceFS mount daemons; `mounts`: the JuiceFS mount points), and once start-up ends (`phase`
"running", with the fleet's URLs for `kvtier status`). It names the process that owns the fleet,
for `kvtier down`, which stops a fleet still starting as one running.

A pid names a process only while that process lives: once `kvtier up` is gone without removing
the file (SIGKILL, out of memory, a reboot), the pid may be any other process's, init's
included. So the file also records the owner's identity (`process_identity`), and that of every
server; a process is taken for the one recorded, and signalled, only while its pid and identity
both match. `kvtier down` on such a stale file stops the recorded servers still running and
unmounts the recorded mounts still mounted, then removes it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from kvtier.core.errors import KvtierError
from kvtier.core.tiers.posix import mount_table

LOCK_FILE = ".lock"
STARTING, RUNNING = "starting", "running"
"""The state file's `phase`: start-up under way (no URLs yet), or the fleet serving."""
STOP_TIMEOUT_S = 10.0
"""How long `kvtier down` waits for a stale file's server to exit after SIGTERM, then SIGKILL."""

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


@dataclass(frozen=True, slots=True)
class Server:
    """A server `kvtier up` started that would outlive it, were it killed (its replicas and
    router stop themselves: `kvtier.core.parent_watch`)."""

    name: str
    pid: int
    identity: str

    @classmethod
    def of(cls, name: str, pid: int) -> Server | None:
        """Process `pid` as it is now (None: it no longer runs, nothing to record)."""
        identity = process_identity(pid)
        return None if identity is None else cls(name, pid, identity)

    def __str__(self) -> str:
        return f"{self.name} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class FleetState:
    """What a state file records: its owner, its phase, what to clean up were the owner gone."""

    pid: int
    identity: str
    phase: str
    servers: tuple[Server, ...]
    mounts: tuple[str, ...]


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
        owner = _read_owner(path, _load(path))
    except KvtierError:
        return False
    return owner == (os.getpid(), process_identity(os.getpid()))


def read_state(path: Path) -> FleetState:
    """The state file `path` (`KvtierError` when missing, unreadable or malformed; a file
    without `phase`, `servers` or `mounts`, from an older `kvtier up`, is a running fleet's
    with none). A recorded mount must lie in the file's directory, the work directory."""
    state = _load(path)
    pid, identity = _read_owner(path, state)
    phase, servers = state.get("phase", RUNNING), state.get("servers", [])
    try:
        recorded = tuple(Server(s["name"], s["pid"], s["identity"]) for s in servers)
        mounts = tuple(state.get("mounts", []))
    except (LookupError, TypeError) as exc:
        raise _invalid(path, f"malformed: {exc!r}") from exc
    if phase not in (STARTING, RUNNING) or not all(map(_valid_server, recorded)):
        raise _invalid(path, f"malformed: phase {phase!r}, servers {servers!r}")
    work_dir = os.path.realpath(path.parent) + os.sep
    if not all(isinstance(m, str) and m.startswith(work_dir) for m in mounts):
        raise _invalid(path, f"mounts outside its directory: {mounts!r}")
    return FleetState(pid, identity, phase, recorded, mounts)


def signal_owner(path: Path, sig: signal.Signals) -> int:
    """Send `sig` to the running `kvtier up`, starting or serving, that wrote `path` and return
    its pid.

    Signals no `kvtier up`, raising `KvtierError`, when `path` is missing, unreadable or
    malformed, names pid 0 or 1 or no valid pid, or is stale: its owner is gone, its pid names
    no process or another one, a thread included. A stale file's recorded servers still
    running are stopped and its mounts still mounted unmounted (under the work directory's
    lock: `clean_stale`), then the file is removed."""
    state = read_state(path)
    pidfd = _open_process(state.pid, state.identity)
    if pidfd is None:
        raise clean_stale(path, state)
    try:
        _send(pidfd, sig, f"the `kvtier up` of {path} (pid {state.pid})")
    finally:
        os.close(pidfd)
    return state.pid


def clean_stale(path: Path, state: FleetState) -> KvtierError:
    """Clean up after the gone `kvtier up` that wrote `path` (read as `state`): unmount its
    recorded mounts still mounted, stop its recorded servers still running (SIGTERM, then
    SIGKILL), remove the file; return the error reporting it. Holds the work directory's lock
    meanwhile, so that no `kvtier up` starts there; raises `KvtierError`, removing nothing,
    if one runs or `path` changed since it was read."""
    with WorkDirLock(path.parent):
        if read_state(path) != state:
            raise KvtierError(f"{path} changed while `kvtier down` read it; run it again")
        unmounted = [point for point in state.mounts if _unmount(point)]
        stopped = [str(server) for server in state.servers if _stop_server(server)]
        path.unlink()
    cleaned = [f"unmounted {', '.join(unmounted)}"] if unmounted else []
    cleaned += [f"stopped {', '.join(stopped)}"] if stopped else []
    return KvtierError(
        f"{path} was stale: the `kvtier up` that wrote it (pid {state.pid}) no longer runs; "
        f"{'; '.join(cleaned) or 'nothing it started was left running, signalled nothing'}; "
        "removed it. Its replicas and router stop themselves (see its logs/)"
    )


def check_leftovers(path: Path) -> None:
    """Raise `KvtierError` where the state file `path` names a `kvtier up` that runs still
    (one of a version that takes no lock on the work directory), or is stale and a server it
    records still runs or a mount it records is still mounted: `kvtier down` stops those first.
    For a new `kvtier up` holding the work directory's lock; a missing or malformed file, or a
    stale one with nothing left running, is for it to overwrite."""
    try:
        state = read_state(path)
    except KvtierError:
        return
    if owner_runs(state):
        raise KvtierError(
            f"{path} names a `kvtier up` that runs still (pid {state.pid}) without a lock on the "
            "work directory (an older version): stop it first. Nothing was started"
        )
    left = left_running(state.servers, state.mounts)
    if left:
        raise KvtierError(
            f"{path} was left by a `kvtier up` (pid {state.pid}) that was killed, and what it "
            f"started still runs: {', '.join(left)}. Run `kvtier down` (same --config) first: "
            "it stops them"
        )


def left_running(servers: Iterable[Server], mounts: Iterable[str]) -> list[str]:
    """Those of `servers` that run still and of `mounts` still mounted, named for a message."""
    running = [str(server) for server in servers if _runs(server.pid, server.identity)]
    return running + [f"the mount {point}" for point in mounts if _fuse_mounted(point)]


def owner_runs(state: FleetState) -> bool:
    """Whether the `kvtier up` that wrote `state` runs still (exited but not yet reaped by
    its parent counts as gone)."""
    return _runs(state.pid, state.identity)


def check_serving(path: Path, recorded: Mapping[str, Any]) -> None:
    """Raise `KvtierError` where the state file `path`, holding `recorded`, is one written while
    start-up was under way (it records no URLs yet), saying whether that `kvtier up` still
    starts or was killed doing so (exited but not yet reaped by its parent counts as killed, as
    in `owner_runs`)."""
    if recorded.get("phase") != STARTING:
        return
    pid, identity = recorded.get("pid"), recorded.get("identity")
    if _valid_pid(pid) and isinstance(identity, str) and _runs(pid, identity):
        raise KvtierError(
            f"the fleet of {path} is starting (`kvtier up`, pid {pid}); its URLs are recorded "
            "once every replica is up: try again then"
        )
    raise KvtierError(
        f"{path} was left by a `kvtier up` (pid {pid!r}) killed while starting: "
        "`kvtier down` (same --config) cleans up after it"
    )


class WorkDirLock:
    """An exclusive lock on a work directory: `flock` on its `.lock`, which holds the holder's
    pid. `kvtier up` holds it for its whole life, `kvtier down` while it cleans up after a
    `kvtier up` that was killed. The kernel drops the lock when its holder exits, however it
    ends, so a lock is never stale; the file stays. Not inherited by child processes."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock at once, or raise `KvtierError` naming the work directory and the
        holder's pid (where written yet) if another process, or another `WorkDirLock`,
        holds it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise KvtierError(f"cannot lock the work directory: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BlockingIOError:
            os.close(fd)
            raise self._in_use() from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Drop the lock, if held."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _in_use(self) -> KvtierError:
        try:
            holder = int(self.path.read_text())
        except (OSError, ValueError):
            holder = None
        return KvtierError(
            f"the work directory {self.path.parent} is in use by another `kvtier up` "
            f"(pid {holder or 'unknown'}); stop it with `kvtier down`, or give this fleet a work "
            "directory of its own (kvtier.workDir). Nothing was started"
        )

    def __enter__(self) -> WorkDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _load(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (`KvtierError` when there is none)."""
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise KvtierError(f"no running cluster recorded in {path}") from None
    except OSError as exc:
        raise KvtierError(f"cannot read {path}: {exc}") from exc
    except ValueError as exc:
        raise _invalid(path, f"malformed: {exc!r}") from exc
    if not isinstance(state, dict):
        raise _invalid(path, f"malformed: {type(state).__name__}, not an object")
    return state


def _read_owner(path: Path, state: Mapping[str, Any]) -> tuple[int, str]:
    """The owner's pid and identity in `state`, read from `path` (`KvtierError` when none)."""
    pid, identity = state.get("pid"), state.get("identity")
    if not _valid_pid(pid) or not isinstance(identity, str):
        raise _invalid(path, f"no valid owner (pid {pid!r}, identity {identity!r})")
    return pid, identity


def _valid_pid(pid: object) -> TypeGuard[int]:
    """Whether `pid` may name a process of ours: an int, not 0 (our group) or 1 (init)."""
    return type(pid) is int and 1 < pid < 2**31


def _valid_server(server: Server) -> bool:
    return (
        isinstance(server.name, str) and _valid_pid(server.pid) and isinstance(server.identity, str)
    )


def _invalid(path: Path, why: str) -> KvtierError:
    return KvtierError(
        f"{path} is not a state file of a running `kvtier up` ({why}); nothing was signalled. "
        "Stop that `kvtier up` with Ctrl-C if one runs, else remove the file"
    )


def _open_process(pid: int, identity: str) -> int | None:
    """A pidfd on process `pid` while it is the process of `identity` (None: no process, or
    another one, a thread included, has that pid). A pidfd keeps naming the process it was
    opened on, even once the pid is reused."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno not in _NOT_A_PROCESS:
            raise
        return None
    if process_identity(pid) != identity:
        os.close(pidfd)
        return None
    return pidfd


def _exited(pidfd: int, timeout_s: float) -> bool:
    """Whether the process of `pidfd` exits within `timeout_s` (0: has exited)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(int(timeout_s * 1000)))


def _send(pidfd: int, sig: signal.Signals, whom: str) -> None:
    """Send `sig` to the process of `pidfd` (`KvtierError` where not permitted)."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except PermissionError as exc:
        raise KvtierError(
            f"not permitted to signal {whom}: run `kvtier down` as the user who ran `kvtier up`"
        ) from exc


def _runs(pid: int, identity: str) -> bool:
    """Whether the process of `pid` and `identity` runs still (has not exited)."""
    pidfd = _open_process(pid, identity)
    if pidfd is None:
        return False
    try:
        return not _exited(pidfd, 0)
    finally:
        os.close(pidfd)


def _stop_server(server: Server) -> bool:
    """Stop `server` if it runs still: SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`. Whether it
    ran; `KvtierError` if it outlives both."""
    pidfd = _open_process(server.pid, server.identity)
    if pidfd is None:
        return False
    try:
        if _exited(pidfd, 0):
            return False
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _send(pidfd, sig, str(server))
            if _exited(pidfd, STOP_TIMEOUT_S):
                return True
    finally:
        os.close(pidfd)
    raise KvtierError(f"{server} did not stop on SIGKILL within {STOP_TIMEOUT_S} s")


def _fuse_mounted(point: str) -> bool:
    """Whether a FUSE file system is mounted at `point`."""
    return any(p == point and kind.startswith("fuse") for p, kind in mount_table())


def _unmount(point: str) -> bool:
    """Unmount the FUSE file system at `point`, if one is mounted there, as a JuiceFS mount is
    (`force_unmount`). Whether one was; `KvtierError` if it stays."""
    from kvtier.tools.l2ops.juicefs import force_unmount

    if not _fuse_mounted(point):
        return False
    if not force_unmount(point):
        raise KvtierError(f"could not unmount {point}")
    return True
