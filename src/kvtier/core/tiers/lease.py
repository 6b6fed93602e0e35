"""A lease in a shared directory: at most one live holder across all replicas and nodes.

Used by the L2 janitor so that exactly one replica enforces the shared directory's capacity.
It needs only what every shared file system we target provides (checked on JuiceFS, Curvine's
docs, NFS): exclusive creation of a name (`link()` fails with EEXIST) and a settable mtime.
No `flock` (not cluster-wide on SeaweedFS) and no rename-over-existing (leaves other nodes with
~1 s of ENOENT on JuiceFS/Curvine).

    <dir>/lease.<epoch>     JSON {holder, ttl_s, pid, host}; its mtime is the heartbeat

- Take: find the highest epoch; if its file's mtime is older than its TTL plus `stale_s` (the
  file system's attribute-cache staleness), publish `lease.<epoch+1>` (temp file + `link()`).
  Two contenders cannot both create the same epoch, so exactly one wins. A contender that
  stalled after its look may find that epoch's name free again only because newer holders
  removed it: a take that is not the highest epoch once linked is withdrawn.
- Hold: the holder renews by touching its file's mtime (no inode replaced, so no stale
  dentries). It has lost the lease when a higher epoch exists or its file is gone.
- Release: set the mtime to 0, i.e. expired, so the next contender needn't wait for the TTL.

A lease file is read without following a symlink, only if it is a regular file, and only up to
`LEASE_MAX_BYTES`: a planted symlink, FIFO or huge file is no lease (expired), so it neither
blocks nor exhausts memory nor keeps the lease from being taken.

Given the shared `root` the directory lies under, the lease refuses a path that a symlink leads
out of (a planted `<root>/.kvtier` symlink would move the lease, and its writes, elsewhere): it
is then never held and `current()` is None, as the janitor refuses symlinks in `usage`.

A holder that dies simply stops renewing; after `ttl_s` another replica takes over. A holder
that stalls past its TTL may act once more before noticing (no fencing): for a cache janitor
that costs at most one extra eviction round, never wrong data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.tiers.usage import real_dir

log = logging.getLogger(__name__)

_PREFIX = "lease."
LEASE_MAX_BYTES = 4096
"""A lease body is ~100 bytes: a bigger file is not a lease, and is not read whole."""


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """Who holds (or last held) the lease."""

    epoch: int
    holder: str
    heartbeat: float
    """Wall-clock time of the holder's last renewal (the file's mtime)."""
    ttl_s: float
    expired: bool


class FileLease:
    """One contender for the lease in `directory` (see the module docstring). Not thread-safe:
    one janitor thread owns it."""

    def __init__(
        self,
        directory: str,
        holder: str,
        ttl_s: float,
        *,
        root: str | None = None,
        stale_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        create: bool = True,
    ) -> None:
        """`create=False` makes no directory (a reader's view, for `current()` alone)."""
        self.directory = directory
        self.holder = holder
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self._clock = clock
        self.epoch: int | None = None
        """The epoch this contender holds, or None."""
        self._root = root
        self._parts = [] if root is None else os.path.relpath(directory, root).split(os.sep)
        self._refused = False
        """Whether the last look found the directory reached through a symlink (logged)."""
        self._cannot_take: int | None = None
        """The errno of the last failed take (logged when it changes), None after a take."""
        if not create:
            return
        if root is None:
            os.makedirs(directory, exist_ok=True)
            return
        os.makedirs(root, exist_ok=True)
        for depth in range(1, len(self._parts) + 1):  # a level at a time, never through a symlink
            if not real_dir(root, *self._parts[: depth - 1]):
                break
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.join(root, *self._parts[:depth]))
        self._usable()

    def _usable(self) -> bool:
        """Whether the directory is reached from `root` through no symlink (logged once when it
        is not, and once when it is again)."""
        if self._root is None:
            return True
        usable = real_dir(self._root, *self._parts)
        if usable == self._refused:
            self._refused = not usable
            if usable:
                log.info("kvtier lease: %s is a directory again", self.directory)
            else:
                log.warning(
                    "kvtier lease: %s is not a directory of its own under %s (a symlink?): "
                    "the lease is not taken",
                    self.directory,
                    self._root,
                )
        return usable

    def _path(self, epoch: int) -> str:
        return os.path.join(self.directory, f"{_PREFIX}{epoch:012d}")

    def _epochs(self) -> list[int]:
        found = []
        for name in os.listdir(self.directory):
            digits = name[len(_PREFIX) :]
            if name.startswith(_PREFIX) and digits.isascii() and digits.isdigit():
                found.append(int(digits))
        return sorted(found)

    def current(self) -> LeaseInfo | None:
        """The newest lease, or None if there has never been one. A lease file whose body is
        not a lease (empty after a crash, foreign junk) is expired: the next epoch is free."""
        if not self._usable():
            return None
        for epoch in reversed(self._epochs()):
            try:
                heartbeat, body = self._read(self._path(epoch))
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    continue  # removed meanwhile: look at the previous one
                heartbeat, body = 0.0, None  # a symlink: not a lease
            if body is None:
                return LeaseInfo(epoch, "?", heartbeat, self.ttl_s, expired=True)
            holder, ttl = body
            expired = heartbeat + ttl + self.stale_s < self._clock()
            return LeaseInfo(epoch, holder, heartbeat, ttl, expired)
        return None

    def _read(self, path: str) -> tuple[float, tuple[str, float] | None]:
        """The heartbeat (mtime) of the lease file `path` and the holder and TTL it names (None
        if it is not a lease). Raises OSError, ELOOP for a symlink."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            raw = os.read(fd, LEASE_MAX_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode) or len(raw) > LEASE_MAX_BYTES:
            return st.st_mtime, None
        return st.st_mtime, self._body(raw)

    def _body(self, raw: bytes) -> tuple[str, float] | None:
        """The holder and TTL a lease file's bytes name; None if they are not a lease."""
        try:
            body = json.loads(raw, parse_int=float)  # (a huge integer: inf, not OverflowError)
        except (ValueError, RecursionError):
            return None
        if not isinstance(body, dict):
            return None
        ttl = body.get("ttl_s", float(self.ttl_s))
        if not isinstance(ttl, float) or not 0 <= ttl < math.inf:
            return None
        return str(body.get("holder", "?")), ttl

    def held(self) -> bool:
        """True if this contender holds the lease and it has not been superseded."""
        if self.epoch is None:
            return False
        if not self._usable():
            self.epoch = None
            return False
        try:
            if self._epochs()[-1] != self.epoch:
                self.epoch = None
        except (OSError, IndexError):
            self.epoch = None
        return self.epoch is not None

    def try_acquire(self) -> bool:
        """Renew the lease if held, else take it if free or expired. True if held now."""
        try:
            if self.held():
                assert self.epoch is not None
                os.utime(self._path(self.epoch), follow_symlinks=False)
                return True
            if not self._usable():
                return False
            latest = self.current()
            if latest is not None and not latest.expired:
                return False
            return self._take((latest.epoch if latest else max(self._epochs(), default=0)) + 1)
        except OSError:
            self.epoch = None  # our file vanished or the directory is unusable: not held
            return False

    def _take(self, epoch: int) -> bool:
        body = json.dumps(
            {
                "holder": self.holder,
                "ttl_s": self.ttl_s,
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        ).encode()
        tmp = os.path.join(self.directory, f".{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            os.link(tmp, self._path(epoch))
        except FileExistsError:
            return False  # another contender won this epoch
        except OSError as exc:  # a full volume, a file system without hard links...
            if exc.errno != self._cannot_take:
                self._cannot_take = exc.errno
                log.warning(
                    "kvtier lease: cannot take the lease in %s (%s): until it can, no replica "
                    "holds it (the L2 janitor does not run)",
                    self.directory,
                    exc,
                )
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._cannot_take = None
        # A stalled contender finds the name free only because newer holders removed it.
        if max(self._epochs(), default=epoch) != epoch:
            with contextlib.suppress(OSError):
                os.unlink(self._path(epoch))
            return False
        self.epoch = epoch
        for old in self._epochs():
            if old < epoch:
                try:
                    os.unlink(self._path(old))
                except OSError:
                    pass
        return True

    def release(self) -> None:
        """Give the lease up now (marks it expired rather than deleting it: epochs only grow)."""
        if self.held():
            assert self.epoch is not None
            try:
                os.utime(self._path(self.epoch), (0, 0), follow_symlinks=False)
            except OSError:
                pass
        self.epoch = None
