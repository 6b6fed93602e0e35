"""`TieredStore` over a real distributed L2: a JuiceFS mount per "node", and Valkey.

Warm restart: a store that starts after others wrote L2 (a restarted or brand-new replica)
sees every block at once; there is no index to rebuild. The Valkey stores are configured by
`StoreSettings.l2_url` alone, as a replica is.
"""

from __future__ import annotations

import os
import time

import pytest

from kvtier.core.codec import HEADER_BYTES, BlockMeta
from kvtier.core.keys import BlockHash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import Tier
from kvtier.core.tiers.lease import FileLease
from kvtier.core.tiers.usage import control_dir, scan
from kvtier.tools.l2ops.juicefs import JuiceFSMount
from kvtier.tools.l2ops.valkey_server import ValkeyServer, start_valkey
from tests.helpers.l2 import (
    IDENTITY,
    make_block,
    needs_fuse,
    poll,
    run_worker,
)

KIB = 1024
COUNT = 6


def blocks(seed: int) -> list[tuple[BlockHash, BlockMeta, bytes]]:
    return [make_block(seed, i, 256 * KIB) for i in range(COUNT)]


def write_through(store: TieredStore, seed: int) -> None:
    for h, meta, payload in blocks(seed):
        assert store.save(h, meta, payload)
    assert store.flush(timeout_s=60)


def assert_all_from_l2(store: TieredStore, seed: int) -> None:
    expected = blocks(seed)
    hashes = [h for h, _, _ in expected]
    tiers = poll(lambda: len(t := store.lookup(hashes)) == COUNT and t, 10)
    assert tiers == [Tier.L2] * COUNT
    loaded = store.load(hashes)
    assert [bytes(b.payload) for b in loaded] == [p for _, _, p in expected]
    assert [b.tier for b in loaded] == [Tier.L2] * COUNT


@pytest.mark.juicefs
@needs_fuse
def test_a_new_store_on_another_mount_finds_every_block_without_a_rebuild(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    with TieredStore(StoreSettings(l1_bytes=64 * 1024**2, l2_path=a.path), IDENTITY) as writer:
        write_through(writer, 50)
    with TieredStore(
        StoreSettings(l1_bytes=64 * 1024**2, l2_path=b.path, l2_exists_ttl_s=0), IDENTITY
    ) as reader:
        assert_all_from_l2(reader, 50)
        stats = reader.stats()
        assert stats.l2 is not None and stats.l2.corrupt_removed == 0


@pytest.mark.juicefs
@needs_fuse
def test_a_store_process_reads_what_another_process_wrote_through_the_other_mount(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    run_worker(
        "write", f"posix:{a.path}", "--seed", "51", "--count", str(COUNT), "--bytes", str(256 * KIB)
    )
    with TieredStore(
        StoreSettings(l1_bytes=0, l2_path=b.path, l2_exists_ttl_s=0), IDENTITY
    ) as reader:
        assert_all_from_l2(reader, 51)


@pytest.mark.juicefs
@needs_fuse
def test_stores_on_two_mounts_share_one_janitor_that_bounds_the_volume(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    root = os.path.join(a.path, "bounded")  # its own root: the janitor scans all of it
    os.mkdir(root)
    root_b = os.path.join(b.path, "bounded")
    assert poll(lambda: os.path.isdir(root_b), deadline_s=10)
    file_bytes = 256 * KIB + HEADER_BYTES
    config = StoreSettings(
        l1_bytes=0,
        l2_path=root,
        l2_exists_ttl_s=0,
        l2_profile="juicefs",
        l2_capacity_bytes=10 * file_bytes,
        l2_high_watermark=0.85,
        l2_low_watermark=0.45,
        l2_janitor_interval_s=0.2,
    )
    with (
        TieredStore(config, IDENTITY) as on_a,
        TieredStore(config.replaced(l2_path=root_b), IDENTITY) as on_b,
    ):
        write_through(on_a, 55)
        write_through(on_b, 56)  # 12 blocks into room for 10: above the high watermark
        assert poll(lambda: scan(root, 600, time.time()).used_bytes <= 4 * file_bytes, 30)
        lease = FileLease(control_dir(root, "lease"), "observer", ttl_s=30).current()
        assert lease is not None and not lease.expired
        # The juicefs profile evicts through the graveyard: open readers elsewhere finish.
        assert scan(root, 600, time.time()).graveyard

        def kept_on_b() -> list[tuple[BlockHash, bytes]]:
            return [
                (h, p)
                for seed in (55, 56)
                for h, _, p in blocks(seed)
                if on_b.contains(h) is Tier.L2
            ]

        # Mount B sees the evictions once its attribute/dentry cache (1 s) expires.
        assert poll(lambda: len(kept_on_b()) == 4, deadline_s=10)
        kept = kept_on_b()
        assert [bytes(blk.payload) for h, p in kept for blk in on_b.load([h])] == [
            p for _, p in kept
        ]
    assert FileLease(control_dir(root, "lease"), "observer", ttl_s=30).current().expired


def valkey_store(url: str, *, l1_bytes: int = 0) -> TieredStore:
    """A store whose L2 is the Valkey server at `url`, built from the config alone."""
    return TieredStore(StoreSettings(l1_bytes=l1_bytes, l2_url=url, l2_exists_ttl_s=0), IDENTITY)


@pytest.mark.valkey
def test_stores_share_blocks_through_valkey_and_a_new_store_sees_them(
    valkey_server: ValkeyServer,
) -> None:
    with valkey_store(valkey_server.url, l1_bytes=64 * 1024**2) as writer:
        write_through(writer, 52)
    with valkey_store(valkey_server.url) as reader:
        assert_all_from_l2(reader, 52)
    report = run_worker(
        "read",
        f"valkey:{valkey_server.url}",
        "--seed",
        "52",
        "--count",
        str(COUNT),
        "--bytes",
        str(256 * KIB),
    )
    assert (report["hits"], report["misses"], report["mismatched"]) == (COUNT, 0, 0)


@pytest.mark.valkey
def test_a_store_hits_blocks_another_process_wrote_to_valkey(valkey_server: ValkeyServer) -> None:
    report = run_worker(
        "write",
        f"valkey:{valkey_server.url}",
        "--seed",
        "53",
        "--count",
        str(COUNT),
        "--bytes",
        str(256 * KIB),
    )
    assert report == {"stored": COUNT, "already_present": 0, "errors": 0}
    with valkey_store(valkey_server.url) as reader:
        assert_all_from_l2(reader, 53)
        stats = reader.stats()
        assert stats.l2 is not None and (stats.l2.hits, stats.l2.errors) == (COUNT, 0)


@pytest.mark.valkey
def test_a_valkey_restart_under_a_store_is_misses_then_recovers() -> None:
    hashes = [h for h, _, _ in blocks(54)]
    server = start_valkey()
    try:
        with valkey_store(server.url) as store:
            write_through(store, 54)
            assert store.lookup(hashes) == [Tier.L2] * COUNT
            server.kill()
            # Down: lookups and loads are misses, saves are still admitted; nothing raises.
            assert store.lookup(hashes) == []
            assert store.load(hashes) == []
            write_through(store, 54)
            stats = store.stats()
            assert stats.l2 is not None and stats.l2.errors >= 1
            assert stats.l2_write_errors == 0
            server.start()  # same port, empty (no persistence): a cold but working L2

            def rewritten() -> bool:
                write_through(store, 54)
                return store.lookup(hashes) == [Tier.L2] * COUNT

            assert poll(rewritten, deadline_s=20, interval_s=0.2)
            assert_all_from_l2(store, 54)
    finally:
        server.stop()
