"""A FUSE passthrough that fails on demand: the L2 faults `kvtier bench chaos` injects.

    python -m kvtier.tools.chaos.faultfs BACKING MOUNTPOINT CONTROL

mirrors BACKING at MOUNTPOINT (one FUSE daemon, libfuse3 through `mfusepy`). CONTROL is a JSON
file, re-read when it changes, that sets the mode of block files (`*.kvt`, and their `.tmp`
siblings):

    {"mode": "ok"}                     pass through
    {"mode": "eio"}                    opening, reading or writing a block fails with EIO
    {"mode": "slow", "delay_s": 3}     every open of a block waits `delay_s` first

Metadata (directories, the volume identity file, stat) always passes through, as with a disk
whose data blocks fail while its directory still answers. `FaultFS` runs the daemon as a child
and unmounts it; its `set_mode` writes the control file.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self

from kvtier.core.errors import TierError
from kvtier.core.tiers.noreplace import RENAME_NOREPLACE, rename_noreplace
from kvtier.tools.l2ops.juicefs import force_unmount, mounted_under

__all__ = ["FaultFS"]

_CONTROL_CHECK_S = 0.1


def _is_block(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".kvt") or (".kvt." in name and name.endswith(".tmp"))


class _Control:
    """The mode in the control file, re-read at most every `_CONTROL_CHECK_S`."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._stamp: float | None = None
        self._checked = 0.0
        self.doc: dict[str, Any] = {"mode": "ok"}

    def current(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._checked < _CONTROL_CHECK_S:
            return self.doc
        with self._lock:
            self._checked = now
            try:
                stamp = os.stat(self._path).st_mtime_ns
                if stamp != self._stamp:
                    with open(self._path, encoding="utf-8") as f:
                        self.doc = json.load(f)
                    self._stamp = stamp
            except (OSError, ValueError):
                pass
        return self.doc


def _operations(root: str, control: _Control) -> Any:
    from mfusepy import FuseOSError, Operations

    class Passthrough(Operations):  # type: ignore[misc]
        use_ns = True

        def _real(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def _fault(self, path: str) -> None:
            if not _is_block(path):
                return
            doc = control.current()
            if doc.get("mode") == "eio":
                raise FuseOSError(errno.EIO)
            if doc.get("mode") == "slow":
                time.sleep(float(doc.get("delay_s", 1.0)))

        def _call(self, fn: Any, *args: Any) -> Any:
            try:
                return fn(*args)
            except OSError as exc:
                raise FuseOSError(exc.errno or errno.EIO) from None

        def access(self, path: str, amode: int) -> int:
            if not os.access(self._real(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            return int(self._call(os.chmod, self._real(path), mode) or 0)

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            self._fault(path)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            return int(self._call(os.open, self._real(path), flags, mode))

        def flush(self, path: str, fh: int) -> int:
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            self._call(os.fsync, fh)
            return 0

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            st = self._call(os.lstat, self._real(path))
            keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_ino")
            attrs = {k: getattr(st, k) for k in keys}
            for k in ("st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
                attrs[k] = getattr(st, k)
            return attrs

        def link(self, target: str, source: str) -> int:
            self._fault(target)
            self._call(os.link, self._real(source), self._real(target))
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            self._call(os.mkdir, self._real(path), mode)
            return 0

        def open(self, path: str, flags: int) -> int:
            self._fault(path)
            return int(self._call(os.open, self._real(path), flags | os.O_CLOEXEC))

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            if _is_block(path) and control.current().get("mode") == "eio":
                raise FuseOSError(errno.EIO)
            return bytes(self._call(os.pread, fh, size, offset))

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *self._call(os.listdir, self._real(path))]

        def release(self, path: str, fh: int) -> int:
            self._call(os.close, fh)
            return 0

        def rename(self, old: str, new: str, flags: int = 0) -> int:
            if flags & ~RENAME_NOREPLACE:  # RENAME_EXCHANGE, RENAME_WHITEOUT: not mirrored
                raise FuseOSError(errno.EINVAL)
            move = rename_noreplace if flags else os.rename
            self._call(move, self._real(old), self._real(new))
            return 0

        def rmdir(self, path: str) -> int:
            self._call(os.rmdir, self._real(path))
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            st = self._call(os.statvfs, self._real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree")
            return {k: getattr(st, k) for k in (*keys, "f_files", "f_flag", "f_frsize")}

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            self._call(os.truncate, self._real(path), length)
            return 0

        def unlink(self, path: str) -> int:
            self._call(os.unlink, self._real(path))
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                self._call(os.utime, self._real(path))
            else:
                self._call(lambda: os.utime(self._real(path), ns=times))
            return 0

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            if _is_block(path) and control.current().get("mode") == "eio":
                raise FuseOSError(errno.EIO)
            return int(self._call(os.pwrite, fh, data, offset))

    return Passthrough()


class FaultFS:
    """A running faultfs mount (see the module docstring)."""

    def __init__(self, backing: str, mountpoint: str, log_path: str) -> None:
        self.backing, self.mountpoint, self.log_path = backing, mountpoint, log_path
        self.control = str(Path(log_path).with_suffix(".control.json"))
        self.process: subprocess.Popen[bytes] | None = None

    def set_mode(self, mode: str, **options: float) -> None:
        tmp = self.control + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"mode": mode, **options}, f)
        os.replace(tmp, self.control)
        time.sleep(2 * _CONTROL_CHECK_S)

    def mount(self, timeout_s: float = 20.0) -> Self:
        """Start the daemon and wait until it serves the mount point; raises `TierError` if it
        does not within `timeout_s`. Failing or interrupted, it unmounts and stops the daemon
        first (its owner never got the object that would)."""
        Path(self.mountpoint).mkdir(parents=True, exist_ok=True)
        if not os.path.exists(self.control):
            self.set_mode("ok")
        cmd = [sys.executable, "-m", __name__, self.backing, self.mountpoint, self.control]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        try:
            self._await_mounted(self.process, timeout_s)
        except BaseException:
            self.unmount()
            raise
        return self

    def _await_mounted(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        """Return once the daemon `process` serves the mount point; raise `TierError` if it
        exits first or does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.mounted():
                return
            if process.poll() is not None:
                break
            time.sleep(0.05)
        raise TierError(f"faultfs at {self.mountpoint} did not mount (log: {self.log_path})")

    def mounted(self) -> bool:
        return os.path.realpath(self.mountpoint) in mounted_under(self.mountpoint)

    def detach(self) -> None:
        """Lazily unmount, as an operator's `fusermount3 -u -z` (the daemon then exits)."""
        subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], check=False)
        self._reap()

    def unmount(self) -> None:
        """Unmount and stop the daemon; never leaves the mount point attached, also where the
        daemon mounted only while it was being stopped (then killed, its mount left dead)."""
        if self.mounted():
            force_unmount(self.mountpoint, binary="/bin/false")
        elif self.process is not None:
            self.process.terminate()  # not mounted (yet): no unmount will make it exit
        self._reap()
        if self.mounted():
            force_unmount(self.mountpoint, binary="/bin/false")

    def _reap(self) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self.process = None


def _fuse_class() -> Any:
    from mfusepy import FUSE

    class FlagsFUSE(FUSE):  # type: ignore[misc]
        """mfusepy's FUSE passing rename's flags on: its own drops them, so a rename asked
        not to replace (kvtier's L2 publish) would silently replace the target."""

        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            decode = (self.encoding, self.errors)
            return int(self.operations.rename(old.decode(*decode), new.decode(*decode), flags))

    return FlagsFUSE


def main() -> None:
    backing, mountpoint, control = sys.argv[1:4]
    _fuse_class()(
        _operations(os.path.realpath(backing), _Control(control)),
        mountpoint,
        foreground=True,
        nothreads=False,
        allow_other=True,
        default_permissions=True,
    )


if __name__ == "__main__":
    main()
