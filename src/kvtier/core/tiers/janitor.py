"""Cluster-wide capacity of a shared L2 directory: one leased janitor, LRU by shared access.

Every replica may run a `Janitor`; a `FileLease` in `<root>/.kvtier/lease/` lets exactly one of
them act at a time, and another takes over within the lease TTL when the holder dies. The holder
runs a pass every `interval_s`:

1. scan the whole directory (every namespace): live blocks (`*.kvt`: size, mtime), in-flight
   temp files, and the graveyard; remove temp files orphaned by crashed writers;
2. if usage (live + in flight) is above the high watermark, or L2 has been idle since the
   previous pass (nothing new or re-used: the same blocks with the same mtimes, compared as
   such, not against this node's clock, which may be skewed against the writers') and usage is
   above the low watermark, evict least recently used blocks until usage is at the low
   watermark;
3. purge graveyard entries older than `grace_s`; write `<root>/.kvtier/status.json`.

**Recency** is a shared access record kept in each block's mtime, not atime (FUSE file systems
don't maintain atime): publishing sets it, and `AccessRecorder.record` (called by the POSIX
tier on a read hit) refreshes it, at most once per `touch_interval_s` per block, so hot blocks
cost one metadata write a minute. Any replica's use is therefore visible to the janitor.

**No deletion under a reader.** JuiceFS does not keep an unlinked file's data for readers on
other mounts (a read on mount B after an unlink on mount A fails with EBADF), and NFS behaves
alike. So with `grace_s > 0` a victim is first *renamed* into `<root>/.kvtier/graveyard/`:
readers that already opened it keep reading the same inode, new opens get ENOENT (a miss), and
the data is deleted `grace_s` later. Readers finish within seconds; `grace_s` is minutes.
Where unlink-while-open is safe for every client (a local directory) `grace_s = 0` unlinks at
once. Graveyard bytes are reported apart: they are already on their way out.

Only the janitor deletes blocks here (the POSIX tier deletes only objects that fail
validation). Deletions are best-effort: an entry that cannot be removed is skipped. Every
removal, rename and status write goes through directories opened with O_NOFOLLOW
(`usage.parent_dir`, `usage.open_dir`), so a symlink planted after the scan leads nowhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Self

from pydantic import Field, model_validator

from kvtier.core.settings import ByteSize, Settings
from kvtier.core.tiers.lease import FileLease
from kvtier.core.tiers.profiles import L2Profile
from kvtier.core.tiers.usage import (
    CONTROL_DIR,
    Entry,
    control_dir,
    open_dir,
    parent_dir,
    plan_eviction,
    scan,
)

log = logging.getLogger(__name__)

STATUS_RETRY_S = 0.01
"""Pause before reading a status file again that was caught mid-rewrite."""
STATUS_FILE = "status.json"
_STATUS_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""A planted symlink is refused (ELOOP), a planted FIFO does not block the open."""


class _LeaseLost(Exception):
    """Raised by `Janitor._renew` to end a scan whose lease another janitor took."""


class JanitorSettings(Settings):
    """Capacity of one shared L2 directory and how the janitor enforces it."""

    capacity_bytes: Annotated[ByteSize, Field(gt=0)]
    """Bytes the L2 directory may hold (all namespaces together)."""
    high_watermark: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of capacity above which a pass evicts."""
    low_watermark: Annotated[float, Field(gt=0, le=1)] = 0.75
    """Fraction of capacity an evicting pass brings usage down to."""
    interval_s: Annotated[float, Field(gt=0)] = 5.0
    """Seconds between passes of the lease holder (and between attempts of the others)."""
    lease_ttl_s: Annotated[float, Field(gt=0)] = 30.0
    """A holder that has not renewed for this long is presumed dead."""
    stale_s: Annotated[float, Field(ge=0)] = 1.0
    """Attribute-cache staleness of the file system (see `kvtier.core.tiers.profiles`)."""
    grace_s: Annotated[float, Field(ge=0)] = 60.0
    """How long an evicted block stays readable for readers that already opened it (0: unlink
    at once, only where unlink-while-open is safe on every node)."""
    temp_max_age_s: Annotated[float, Field(gt=0)] = 600.0
    """Temp files older than this belong to crashed writers and are removed."""
    trim_when_idle: bool = True
    """Trim to the low watermark once writes stop, so the next burst starts with headroom."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark: must not exceed high_watermark "
                f"({self.high_watermark}), got {self.low_watermark}"
            )
        if self.lease_ttl_s < 2 * self.interval_s:
            raise ValueError(
                f"lease_ttl_s: must be at least twice interval_s "
                f"({self.interval_s}), got {self.lease_ttl_s}"
            )
        return self

    @classmethod
    def for_profile(cls, profile: L2Profile, capacity_bytes: int | str, **overrides: Any) -> Self:
        """Settings whose staleness, lease and grace suit the file system of `profile`; the
        lease outlives a few passes (`interval_s` in `overrides`) and the staleness."""
        lease_ttl_s = max(
            30.0,
            10 * profile.attr_cache_s,
            3 * float(overrides.get("interval_s", cls.model_fields["interval_s"].default)),
        )
        settings: dict[str, Any] = {
            "capacity_bytes": capacity_bytes,
            "stale_s": profile.attr_cache_s,
            "lease_ttl_s": lease_ttl_s,
            "grace_s": 0.0 if profile.unlink_safe_across_nodes else 60.0,
        }
        return cls.from_mapping({**settings, **overrides})

    @property
    def high_bytes(self) -> int:
        return int(self.capacity_bytes * self.high_watermark)

    @property
    def low_bytes(self) -> int:
        return int(self.capacity_bytes * self.low_watermark)


@dataclass(frozen=True, slots=True)
class PassReport:
    """One janitor pass, as written to `status.json`."""

    holder: str
    epoch: int
    started_at: float
    finished_at: float
    capacity_bytes: int
    high_bytes: int
    low_bytes: int
    used_bytes_before: int
    used_bytes_after: int
    blocks_after: int
    graveyard_bytes: int
    trigger: str | None
    """Why blocks were evicted: "high" (above the high watermark), "idle" (trim after writes
    stopped), "forced" (`kvtier l2 gc --to-low`), or None."""
    evicted_blocks: int
    evicted_bytes: int
    purged_bytes: int
    orphans_removed: int


@dataclass(frozen=True, slots=True)
class JanitorStats:
    """One janitor's totals since it started (what it did as the lease holder)."""

    lease_held: bool
    """It held the lease after its latest attempt."""
    passes: int
    evicted_blocks: int
    evicted_bytes: int
    orphans_removed: int
    last_report: PassReport | None
    """Its latest pass (None until it held the lease once)."""


def _fingerprint(blocks: Iterable[Entry]) -> tuple[int, int]:
    """(count, XOR of (path, mtime) hashes) of `blocks`: changes when a block is written,
    re-used or removed; XOR so that the blocks evicted from a scan can be taken out again."""
    count = digest = 0
    for e in blocks:
        count += 1
        digest ^= hash((e.path, e.mtime))
    return count, digest


class AccessRecorder:
    """The readers' half of the shared access record (see the module docstring).

    `record(fd, st_mtime)` is called by the POSIX tier after a read hit, with the open file
    and the mtime its `fstat` returned; it touches the block's mtime when that is older than
    `touch_interval_s`. Never raises (a failed touch only makes the block look older).
    Thread-safe: the tier's readers share one recorder.
    """

    def __init__(
        self, touch_interval_s: float = 60.0, clock: Callable[[], float] = time.time
    ) -> None:
        self._interval = touch_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.touches = 0
        self.failures = 0

    def record(self, fd: int, st_mtime: float) -> bool:
        """Refresh the block's recency if stale; True if it was touched."""
        if self._clock() - st_mtime < self._interval:
            return False
        try:
            os.utime(fd)
        except OSError:
            touched = False
        else:
            touched = True
        with self._lock:
            if touched:
                self.touches += 1
            else:
                self.failures += 1
        return touched


class Janitor:
    """Capacity enforcement for one shared L2 root; owns one background thread."""

    def __init__(
        self,
        root: str,
        config: JanitorSettings,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.config = config
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._clock = clock
        self.lease = FileLease(
            control_dir(root, "lease"),
            self.holder,
            config.lease_ttl_s,
            root=root,
            stale_s=config.stale_s,
            clock=clock,
        )
        self._last_seen: tuple[int, int] | None = None
        """`_fingerprint` of the blocks our previous pass left, None without one."""
        self._renewed = 0.0
        """When the lease was last renewed (this janitor's clock)."""
        self._unreadable = False
        """Whether the last scan found directories it could not read (logged when it changes)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.last_report: PassReport | None = None
        self._evicted_blocks = self._evicted_bytes = self._orphans_removed = 0

    # ---- one pass ------------------------------------------------------------------------

    def run_once(self, *, force_low: bool = False) -> PassReport | None:
        """Take or renew the lease and run one pass; None if another janitor holds it.

        `force_low` evicts down to the low watermark whatever the usage (`kvtier l2 gc`).
        """
        if not self.lease.try_acquire():
            self._last_seen = None  # a future pass of ours must not trust an old baseline
            return None
        started = self._renewed = self._clock()
        try:
            usage = scan(self.root, self.config.temp_max_age_s, started, tick=self._renew)
        except _LeaseLost:
            self._last_seen = None
            return None
        if bool(usage.unreadable) != self._unreadable:
            self._unreadable = bool(usage.unreadable)
            if usage.unreadable:
                log.warning(
                    "kvtier L2 janitor: cannot read %s (%s) and %d more: their blocks are "
                    "neither counted nor evicted",
                    *usage.unreadable[0],
                    len(usage.unreadable) - 1,
                )
        seen = _fingerprint(usage.blocks)
        idle = self.config.trim_when_idle and usage.temp_bytes == 0 and seen == self._last_seen
        victims = plan_eviction(usage, self.config, trim=idle or force_low)
        trigger = (
            None
            if not victims
            else "high"
            if usage.used_bytes > self.config.high_bytes
            else "forced"
            if force_low
            else "idle"
        )
        evicted = self._evict(victims)
        orphans = sum(self._unlink(e.path) for e in usage.orphans)
        purged = self._purge(usage.graveyard, started)
        gone = _fingerprint(evicted)
        self._last_seen = (seen[0] - gone[0], seen[1] ^ gone[1])
        evicted_bytes = sum(e.size for e in evicted)
        report = PassReport(
            holder=self.holder,
            epoch=self.lease.epoch or 0,
            started_at=started,
            finished_at=self._clock(),
            capacity_bytes=self.config.capacity_bytes,
            high_bytes=self.config.high_bytes,
            low_bytes=self.config.low_bytes,
            used_bytes_before=usage.used_bytes,
            used_bytes_after=usage.used_bytes - evicted_bytes,
            blocks_after=len(usage.blocks) - len(evicted),
            graveyard_bytes=sum(e.size for e in usage.graveyard)
            - purged
            + (evicted_bytes if self.config.grace_s > 0 else 0),
            trigger=trigger,
            evicted_blocks=len(evicted),
            evicted_bytes=evicted_bytes,
            purged_bytes=purged,
            orphans_removed=orphans,
        )
        self.passes += 1
        self.last_report = report
        self._evicted_blocks += report.evicted_blocks
        self._evicted_bytes += report.evicted_bytes
        self._orphans_removed += report.orphans_removed
        self._write_status(report)
        return report

    def _renew(self) -> None:
        """Renew the lease during a scan, at most once per `interval_s`: a scan that outlasted
        the lease would let another janitor act beside this one. Raises `_LeaseLost`."""
        now = self._clock()
        if now - self._renewed < self.config.interval_s:
            return
        if not self.lease.try_acquire():
            raise _LeaseLost
        self._renewed = now

    def _evict(self, victims: list[Entry]) -> list[Entry]:
        if not victims:
            return []
        grave = self._graveyard() if self.config.grace_s > 0 else None
        if self.config.grace_s > 0 and grave is None:
            log.warning("kvtier L2 janitor: no graveyard under %s: nothing evicted", self.root)
            return []
        done = []
        try:
            for i, entry in enumerate(victims):
                if i % 64 == 63 and not self.lease.try_acquire():
                    break  # lost the lease mid-pass (stalled too long): the new holder goes on
                try:
                    with parent_dir(self.root, entry.path) as (fd, name):
                        if grave is not None:
                            stamp = f"{time.time_ns()}.{uuid.uuid4().hex[:8]}"
                            os.rename(name, f"{stamp}.{name}", src_dir_fd=fd, dst_dir_fd=grave)
                        else:
                            os.unlink(name, dir_fd=fd)
                except OSError:
                    continue  # gone already, not removable, or a symlink on its way: skip it
                done.append(entry)
        finally:
            if grave is not None:
                os.close(grave)
        return done

    def _graveyard(self) -> int | None:
        """A descriptor of the graveyard directory, made if missing (the caller closes it);
        None unless it and `.kvtier` are real directories (through a planted symlink, evicted
        blocks would leave L2)."""
        with contextlib.suppress(OSError):
            control = open_dir(self.root, CONTROL_DIR)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir("graveyard", dir_fd=control)
            finally:
                os.close(control)
            return open_dir(self.root, CONTROL_DIR, "graveyard")
        return None

    def _purge(self, graveyard: tuple[Entry, ...], now: float) -> int:
        return sum(
            e.size
            for e in graveyard
            if now - e.mtime >= self.config.grace_s and self._unlink(e.path)
        )

    def _unlink(self, path: str) -> bool:
        """Remove `path` (listed by the scan) unless a level on its way is now a symlink."""
        try:
            with parent_dir(self.root, path) as (fd, name):
                os.unlink(name, dir_fd=fd)
            return True
        except OSError:
            return False

    def _write_status(self, report: PassReport) -> None:
        """Publish the pass for `kvtier l2 status`; best-effort.

        Rewritten in place, not replaced by rename: a rename-over leaves other mounts with
        ~1 s of ENOENT (stale dentries), while in place they see the previous report until
        their attribute cache expires. A reader racing the write sees a JSON prefix, which
        fails to parse (`read_status` answers None), never a mix of two reports.
        """
        body = json.dumps(asdict(report), indent=2).encode()
        try:
            control = open_dir(self.root, CONTROL_DIR)
            try:
                fd = os.open(
                    STATUS_FILE,
                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _STATUS_FLAGS,
                    0o644,
                    dir_fd=control,
                )
            finally:
                os.close(control)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
        except OSError:
            pass

    def stats(self) -> JanitorStats:
        """Its totals (read from any thread: plain attribute reads of the janitor's thread)."""
        return JanitorStats(
            lease_held=self.lease.epoch is not None,
            passes=self.passes,
            evicted_blocks=self._evicted_blocks,
            evicted_bytes=self._evicted_bytes,
            orphans_removed=self._orphans_removed,
            last_report=self.last_report,
        )

    # ---- background thread ---------------------------------------------------------------

    def start(self) -> Janitor:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="kvtier-l2-janitor", daemon=True
            )
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # a janitor fault must never take its replica down
                log.exception("kvtier L2 janitor pass failed; retrying next interval")
            self._stop.wait(self.config.interval_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the thread and hand the lease over at once. A pass stuck in a hung mount is
        waited for up to `timeout_s`, then left (a daemon thread) with the lease, which then
        expires by its TTL: handing it over would touch the same mount."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning(
                    "kvtier L2 janitor: its pass did not end within %s s; the lease expires by "
                    "its TTL",
                    timeout_s,
                )
                return
            self._thread = None
        self.lease.release()


def read_status(
    root: str, attempts: int = 3, pause: Callable[[float], None] = time.sleep
) -> dict[str, object] | None:
    """The last pass report any janitor wrote, or None.

    A read that races a rewrite sees a JSON prefix; it is read again (`attempts` in all,
    `STATUS_RETRY_S` apart) so that a reader does not lose the report for a whole interval.
    A status file that is a symlink, or a `.kvtier` that is one, is no report (None).
    """
    for attempt in range(attempts):
        if attempt:
            pause(STATUS_RETRY_S)
        try:
            control = open_dir(root, CONTROL_DIR)
            try:
                fd = os.open(STATUS_FILE, os.O_RDONLY | _STATUS_FLAGS, dir_fd=control)
            finally:
                os.close(control)
            with open(fd, encoding="utf-8") as f:
                return json.load(f)  # type: ignore[no-any-return]
        except OSError:
            return None
        except ValueError:
            continue
    return None
