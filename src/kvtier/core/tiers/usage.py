"""What a shared L2 directory holds, and which blocks to evict: the janitor's pure half.

    <root>/<namespace>/<h[0:2]>/<h[2:4]>/<h>.kvt     live blocks (size, mtime = last use)
    <root>/<namespace>/.../<h>.kvt.<random>.tmp       blocks being written (or orphaned)
    <root>/.kvtier/graveyard/<time>.<random>.<h>.kvt  evicted, kept for readers, then purged

`scan` walks the directory (I/O, no changes); `plan_eviction` picks victims from a scan (pure).
The janitor (`kvtier.core.tiers.janitor`) acts on them; `kvtier l2 status` and `verify` read
them too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BLOCK_SUFFIX",
    "CONTROL_DIR",
    "TEMP_SUFFIX",
    "Entry",
    "Usage",
    "control_dir",
    "plan_eviction",
    "scan",
]

CONTROL_DIR = ".kvtier"
"""Janitor state under the L2 root; never a namespace (namespaces are hex digests)."""
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


def _walk(directory: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except OSError:
        return  # vanished or unreadable: nothing to account here
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _walk(entry.path)
            elif entry.is_file(follow_symlinks=False):
                yield entry
        except OSError:
            continue


def scan(root: str, temp_max_age_s: float, now: float) -> Usage:
    """Walk every namespace under `root` and the graveyard."""
    blocks: list[Entry] = []
    orphans: list[Entry] = []
    temp_bytes = 0
    try:
        tops = [e for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        tops = []
    for top in tops:
        for f in _walk(top.path):
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
    for f in _walk(control_dir(root, "graveyard")):
        try:
            st = f.stat(follow_symlinks=False)
            graveyard.append(Entry(f.path, st.st_size, float(f.name.split(".", 1)[0]) / 1e9))
        except (OSError, ValueError):
            continue
    return Usage(tuple(blocks), temp_bytes, tuple(orphans), tuple(graveyard))


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
