"""What a shared L2 directory holds, and which blocks to evict: the janitor's pure half.

    <root>/<namespace>/<h[0:2]>/<h[2:4]>/<h>.kvt     live blocks (size, mtime = last use)
    <root>/<namespace>/.../<h>.kvt.<random>.tmp       blocks being written (or orphaned)
    <root>/.kvtier/graveyard/<time>.<random>.<h>.kvt  evicted, kept for readers, then purged

`scan` walks the directory (I/O, no changes); `plan_eviction` picks victims from a scan (pure).
No walk follows a symlink (anyone who can write the root can plant one): a symlink, a
top-level entry that is not a namespace, or a `.kvtier` or graveyard that is not a real
directory, is skipped, so nothing outside the root is ever counted or deleted. A directory
that cannot be listed is skipped too, and named in `Usage.unreadable` (one that vanished is not).
The janitor (`kvtier.core.tiers.janitor`) acts on them; `kvtier l2 status` and `verify` read
them too.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BLOCK_SUFFIX",
    "CONTROL_DIR",
    "NAMESPACE",
    "TEMP_SUFFIX",
    "Entry",
    "Usage",
    "control_dir",
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


def _entries(directory: str, unreadable: list[tuple[str, str]]) -> list[os.DirEntry[str]]:
    """The entries of `directory`; none if it vanished, none and noted in `unreadable` if it
    cannot be read."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            unreadable.append((directory, exc.strerror or str(exc)))
        return []


def _walk(directory: str, unreadable: list[tuple[str, str]]) -> Iterator[os.DirEntry[str]]:
    """Regular files under `directory`, at any depth; symlinks are neither followed nor listed."""
    for entry in _entries(directory, unreadable):
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _walk(entry.path, unreadable)
            elif entry.is_file(follow_symlinks=False):
                yield entry
        except OSError:
            continue


def _namespaces(root: str, unreadable: list[tuple[str, str]]) -> Iterator[os.DirEntry[str]]:
    """The namespace directories under `root` (never a symlink, never `.kvtier`)."""
    for entry in _entries(root, unreadable):
        try:
            if NAMESPACE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                yield entry
        except OSError:
            continue


def _graveyard(root: str, unreadable: list[tuple[str, str]]) -> Iterator[os.DirEntry[str]]:
    """The files in the graveyard; none where it, or `.kvtier`, is not a real directory."""
    if real_dir(root, CONTROL_DIR, "graveyard"):
        yield from _walk(control_dir(root, "graveyard"), unreadable)


def scan(root: str, temp_max_age_s: float, now: float) -> Usage:
    """Walk every namespace under `root` and the graveyard (see the module docstring)."""
    blocks: list[Entry] = []
    orphans: list[Entry] = []
    unreadable: list[tuple[str, str]] = []
    temp_bytes = 0
    for top in _namespaces(root, unreadable):
        for f in _walk(top.path, unreadable):
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
    for f in _graveyard(root, unreadable):
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
