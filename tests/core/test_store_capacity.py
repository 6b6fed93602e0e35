"""A `TieredStore` configured with `l2_capacity_bytes` keeps its L2 directory within bounds.

The store runs the capacity janitor itself (`kvtier.core.tiers.shared`) and its POSIX tier records
read hits in the shared access record (block mtimes), so the janitor evicts the least recently
*used* blocks. Blocks are 64 KiB payloads (+ the 4 KiB header) in a local directory; the
capacity is ten files, high watermark 8.5 files, low 4.5 files.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvtier.core.codec import HEADER_BYTES
from kvtier.core.keys import BlockHash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import Tier
from kvtier.core.tiers.janitor import read_status
from kvtier.core.tiers.lease import FileLease
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.usage import control_dir, scan
from tests.helpers.l2 import IDENTITY, NAMESPACE, make_block, poll

BLOCK = 64 * 1024
FILE = BLOCK + HEADER_BYTES
CAPACITY = 10 * FILE
LOW_FILES = 4  # the most whole files at or below the low watermark (4.5 files)


def store_config(root: Path, **kw: object) -> StoreSettings:
    """L1 off, so every read goes to L2; one writer thread, so blocks publish in save order."""
    values: dict[str, object] = {
        "l1_bytes": 0,
        "l2_path": str(root),
        "l2_exists_ttl_s": 0,
        "io_threads": 1,
    } | kw
    return StoreSettings(**values)


def capacity_config(root: Path) -> StoreSettings:
    return store_config(
        root,
        l2_capacity_bytes=CAPACITY,
        l2_high_watermark=0.85,
        l2_low_watermark=0.45,
        l2_janitor_interval_s=0.1,
    )


def save_blocks(store: TieredStore, seed: int, count: int) -> list[BlockHash]:
    hashes = []
    for i in range(count):
        h, meta, payload = make_block(seed, i, BLOCK)
        assert store.save(h, meta, payload)
        hashes.append(h)
    assert store.flush(timeout_s=60)
    return hashes


def used_bytes(root: Path) -> int:
    return scan(str(root), 600, time.time()).used_bytes


def test_the_store_janitor_evicts_to_the_low_watermark_and_hands_its_lease_over(
    tmp_path: Path,
) -> None:
    with TieredStore(capacity_config(tmp_path), IDENTITY) as store:
        hashes = save_blocks(store, 60, 12)  # 12 files written into room for 10
        # Above high (8.5 files) the janitor evicts down to low; once writes stop, an idle L2
        # above low is trimmed to it as well: either way, 4 files remain.
        assert poll(lambda: used_bytes(tmp_path) <= LOW_FILES * FILE, deadline_s=30)
        assert used_bytes(tmp_path) == LOW_FILES * FILE
        present = [h for h in hashes if store.contains(h) is Tier.L2]
        assert len(present) == LOW_FILES
        loaded = store.load(present)
        assert [bytes(b.payload) for b in loaded] == [
            make_block(60, hashes.index(h), BLOCK)[2] for h in present
        ]
        status = read_status(str(tmp_path))
        assert status is not None and status["capacity_bytes"] == CAPACITY
    lease = FileLease(control_dir(str(tmp_path), "lease"), "observer", ttl_s=1).current()
    assert lease is not None and lease.expired  # released at close, not left to its TTL
    assert not [t for t in threading.enumerate() if t.name == "kvtier-l2-janitor"]


def test_a_recently_read_old_block_survives_eviction_over_unread_newer_ones(tmp_path: Path) -> None:
    # Replicas without a capacity write nine blocks (more than the high watermark allows) ...
    with TieredStore(store_config(tmp_path), IDENTITY) as writer:
        hashes = save_blocks(writer, 61, 9)
    paths = [PosixTier(str(tmp_path), NAMESPACE, IDENTITY.manifest()).path(h) for h in hashes]
    now = time.time()
    for i, path in enumerate(paths):  # ... long ago, block 0 first
        os.utime(path, (now - 1000 + i, now - 1000 + i))
    # ... and one of them reads the oldest block now: its read refreshes the shared record.
    with TieredStore(store_config(tmp_path), IDENTITY) as reader:
        (block,) = reader.load(hashes[:1])
        assert block.tier is Tier.L2
    assert os.stat(paths[0]).st_mtime >= now - 5
    # A replica with a capacity starts; its janitor evicts the least recently used blocks.
    with TieredStore(capacity_config(tmp_path), IDENTITY) as store:
        assert poll(lambda: used_bytes(tmp_path) <= LOW_FILES * FILE, deadline_s=30)
        kept = [i for i, h in enumerate(hashes) if store.contains(h) is Tier.L2]
    assert kept == [0, 6, 7, 8]  # blocks 1-5 were newer than block 0 but never read
