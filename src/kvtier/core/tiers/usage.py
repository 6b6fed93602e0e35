"""What a shared L2 directory holds, and which blocks to evict: the janitor's pure half.

    <root>/<namespace>/<h[0:2]>/<h[2:4]>/<h>.kvt     live blocks (size, mtime = last use)
    <root>/<namespace>/.../<h>.kvt.<random>.tmp       blocks being written (or orphaned)
    <root>/.kvtier/graveyard/<time>.<random>.<h>.kvt  evicted, kept for readers, then purged

`scan` walks the directory (I/O, no changes); `plan_eviction` picks victims from a scan (pure).
No walk follows a symlink (anyone who can write the root can plant one): a symlink, a
top-level entry that is not a namespace, or a `.kvtier` or graveyard that is not a real
directory, is skipped. A directory that cannot be listed is skipped too, and named in
`Usage.unreadable` (one that vanished is not), as is one nested deeper than `MAX_DEPTH` (not
walked: a planted deep tree must not exhaust the stack). Whoever deletes what a scan listed
does it through `parent_dir`, which opens each directory level with O_NOFOLLOW, so nothing
outside the root is ever deleted even where a directory is swapped for a symlink after its
check (`os.unlink(path)` would follow it). The scan itself still lists by path: a swap in the
instant between its check and its listing can get files outside the root counted, not deleted.
The janitor (`kvtier.core.tiers.janitor`) acts on them; `kvtier l2 status` and `verify` read
them too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BLOCK_SUFFIX",
    "CONTROL_DIR",
    "MAX_DEPTH",
    "NAMESPACE",
    "TEMP_SUFFIX",
    "Entry",
    "Usage",
    "control_dir",
    "open_dir",
    "parent_dir",
    "plan_eviction",
    "real_dir",
    "scan",
]

CONTROL_DIR = ".kvtier"
"""Janitor state under the L2 root; never a namespace (namespaces are hex digests)."""
NAMESPACE = re.compile(r"[0-9a-f]{1,64}")
"""What a namespace, i.e. a directory under the L2 root, is named: a hex digest."""
BLOCK_SUFFIX = ".kvt"
TEMP_SUFFIX = ".tmp"
MAX_DEPTH = 8
"""Directory levels a scan descends below a namespace or the graveyard (blocks lie 2 down)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Entry:
    path: str
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class Usage:
    """What a scan of the L2 directory found."""

    blocks: tuple[Entry, ...]
    temp_bytes: int
    """Bytes of temp files being written right now."""
    orphans: tuple[Entry, ...]
    """Temp files older than `temp_max_age_s`."""
    graveyard: tuple[Entry, ...]
    unreadable: tuple[tuple[str, str], ...] = ()
    """(directory, reason) of every directory the scan could not list: not accounted."""

    @property
    def block_bytes(self) -> int:
        return sum(e.size for e in self.blocks)

    @property
    def used_bytes(self) -> int:
        """Live blocks plus blocks being written: what the watermarks apply to."""
        return self.block_bytes + self.temp_bytes

    @property
    def newest_mtime(self) -> float:
        return max((e.mtime for e in self.blocks), default=0.0)


class Watermarks(Protocol):
    """Where eviction starts and stops, in bytes (`JanitorSettings` provides them)."""

    @property
    def high_bytes(self) -> int: ...

    @property
    def low_bytes(self) -> int: ...


def control_dir(root: str, *parts: str) -> str:
    return os.path.join(root, CONTROL_DIR, *parts)


def real_dir(root: str, *parts: str) -> bool:
    """Whether `<root>/<parts...>` is a directory reached through no symlink below `root`."""
    path = root
    for part in parts:
        path = os.path.join(path, part)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False
        except OSError:
            return False
    return True


def open_dir(root: str, *parts: str) -> int:
    """A descriptor of the directory `<root>/<parts...>`, opened a level at a time from `root`
    with O_NOFOLLOW; the caller closes it. Raises OSError (ELOOP, ENOTDIR, ENOENT...) where a
    level is a symlink, not a directory, or missing. Each part is one name (not `.`, `..`)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            if part in ("", os.curdir, os.pardir) or os.sep in part:
                raise OSError(errno.EINVAL, "not a name", part)
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def parent_dir(root: str, path: str) -> Iterator[tuple[int, str]]:
    """`(fd, name)`: the directory holding `path` (a path under `root`, as `scan` lists it),
    opened as by `open_dir`, and its name there; for `os.unlink(name, dir_fd=fd)` and
    `os.rename(name, ..., src_dir_fd=fd)`, which do not follow a symlink swapped in since the
    scan. Raises OSError as `open_dir` does, and EINVAL for a path outside `root`."""
    *parts, name = os.path.relpath(path, root).split(os.sep)
    if name in ("", os.curdir, os.pardir):
        raise OSError(errno.EINVAL, "not a name", path)
    fd = open_dir(root, *parts)
    try:
        yield fd, name
    finally:
        os.close(fd)


_Tick = Callable[[], None] | None
"""Called before each directory a scan lists; may raise to abort the scan."""


def _entries(
    directory: str, unreadable: list[tuple[str, str]], tick: _Tick
) -> list[os.DirEntry[str]]:
    """The entries of `directory`; none if it vanished, none and noted in `unreadable` if it
    cannot be read."""
    if tick is not None:
        tick()
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            unreadable.append((directory, exc.strerror or str(exc)))
        return []


def _walk(
    directory: str, unreadable: list[tuple[str, str]], tick: _Tick, depth: int = 0
) -> Iterator[os.DirEntry[str]]:
    """Regular files under `directory`, down to `MAX_DEPTH` levels (a deeper directory is named
    in `unreadable`); symlinks are neither followed nor listed."""
    for entry in _entries(directory, unreadable, tick):
        try:
            if entry.is_dir(follow_symlinks=False):
                if depth < MAX_DEPTH:
                    yield from _walk(entry.path, unreadable, tick, depth + 1)
                else:
                    unreadable.append((entry.path, f"nested deeper than {MAX_DEPTH} levels"))
            elif entry.is_file(follow_symlinks=False):
                yield entry
        except OSError:
            continue


def _namespaces(
    root: str, unreadable: list[tuple[str, str]], tick: _Tick
) -> Iterator[os.DirEntry[str]]:
    """The namespace directories under `root` (never a symlink, never `.kvtier`)."""
    for entry in _entries(root, unreadable, tick):
        try:
            if NAMESPACE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                yield entry
        except OSError:
            continue


def _graveyard(
    root: str, unreadable: list[tuple[str, str]], tick: _Tick
) -> Iterator[os.DirEntry[str]]:
    """The files in the graveyard; none where it, or `.kvtier`, is not a real directory."""
    if real_dir(root, CONTROL_DIR, "graveyard"):
        yield from _walk(control_dir(root, "graveyard"), unreadable, tick)


def scan(root: str, temp_max_age_s: float, now: float, *, tick: _Tick = None) -> Usage:
    """Walk every namespace under `root` and the graveyard (see the module docstring).

    `tick` is called before each directory is listed (the janitor renews its lease there, as
    a scan of a large directory can outlast the lease); what it raises ends the scan."""
    blocks: list[Entry] = []
    orphans: list[Entry] = []
    unreadable: list[tuple[str, str]] = []
    temp_bytes = 0
    for top in _namespaces(root, unreadable, tick):
        for f in _walk(top.path, unreadable, tick):
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue  # removed between listing and stat
            entry = Entry(f.path, st.st_size, st.st_mtime)
            if f.name.endswith(BLOCK_SUFFIX):
                blocks.append(entry)
            elif f.name.endswith(TEMP_SUFFIX):
                if now - st.st_mtime > temp_max_age_s:
                    orphans.append(entry)
                else:
                    temp_bytes += st.st_size
    graveyard = []
    for f in _graveyard(root, unreadable, tick):
        try:
            st = f.stat(follow_symlinks=False)
            graveyard.append(Entry(f.path, st.st_size, float(f.name.split(".", 1)[0]) / 1e9))
        except (OSError, ValueError):
            continue
    return Usage(tuple(blocks), temp_bytes, tuple(orphans), tuple(graveyard), tuple(unreadable))


def plan_eviction(usage: Usage, config: Watermarks, *, trim: bool) -> list[Entry]:
    """Blocks to evict, least recently used first (pure: no I/O).

    Above the high watermark, or above the low one when `trim` is asked for, evict down to the
    low watermark; otherwise nothing.
    """
    used = usage.used_bytes
    if used <= config.low_bytes or (used <= config.high_bytes and not trim):
        return []
    victims = []
    for entry in sorted(usage.blocks, key=lambda e: (e.mtime, e.path)):
        if used <= config.low_bytes:
            break
        victims.append(entry)
        used -= entry.size
    return victims
