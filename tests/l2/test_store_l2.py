"""`TieredStore` over a real distributed L2: a JuiceFS mount per "node", and Valkey.

Warm restart: a store that starts after others wrote L2 (a restarted or brand-new replica)
sees every block at once; there is no index to rebuild.
"""

from __future__ import annotations

import pytest

from kvtier.config import StoreConfig
from kvtier.events import Tier
from kvtier.l2.juicefs import JuiceFSMount
from kvtier.l2.valkey_server import ValkeyServer
from kvtier.store import TieredStore
from kvtier.tiers.valkey import ValkeyTier, ValkeyTierConfig
from tests.l2.l2_fixtures import (
    IDENTITY,
    NAMESPACE,
    make_block,
    needs_fuse,
    poll,
    run_worker,
    two_mounts,
    valkey_server,
)

__all__ = ["two_mounts", "valkey_server"]  # fixtures, re-exported for pytest

KIB = 1024
COUNT = 6


def blocks(seed: int) -> list[tuple[bytes, object, bytes]]:
    return [make_block(seed, i, 256 * KIB) for i in range(COUNT)]


def write_through(store: TieredStore, seed: int) -> None:
    for h, meta, payload in blocks(seed):
        assert store.save(h, meta, payload)  # type: ignore[arg-type]
    assert store.flush(timeout_s=60)


def assert_all_from_l2(store: TieredStore, seed: int) -> None:
    expected = blocks(seed)
    hashes = [h for h, _, _ in expected]
    tiers = poll(lambda: len(t := store.lookup(hashes)) == COUNT and t, 10)  # type: ignore[arg-type]
    assert tiers == [Tier.L2] * COUNT
    loaded = store.load(hashes)  # type: ignore[arg-type]
    assert [bytes(b.payload) for b in loaded] == [p for _, _, p in expected]
    assert [b.tier for b in loaded] == [Tier.L2] * COUNT


@pytest.mark.juicefs
@needs_fuse
def test_a_new_store_on_another_mount_finds_every_block_without_a_rebuild(
        two_mounts: tuple[JuiceFSMount, JuiceFSMount]) -> None:
    a, b = two_mounts
    with TieredStore(StoreConfig(l1_bytes=64 * 1024**2, l2_path=a.path), IDENTITY) as writer:
        write_through(writer, 50)
    with TieredStore(StoreConfig(l1_bytes=64 * 1024**2, l2_path=b.path,
                                 l2_exists_ttl_s=0), IDENTITY) as reader:
        assert_all_from_l2(reader, 50)
        stats = reader.stats()
        assert stats.l2 is not None and stats.l2.corrupt_removed == 0


@pytest.mark.juicefs
@needs_fuse
def test_a_store_process_reads_what_another_process_wrote_through_the_other_mount(
        two_mounts: tuple[JuiceFSMount, JuiceFSMount]) -> None:
    a, b = two_mounts
    run_worker("write", f"posix:{a.path}", "--seed", "51", "--count", str(COUNT),
               "--bytes", str(256 * KIB))
    with TieredStore(StoreConfig(l1_bytes=0, l2_path=b.path, l2_exists_ttl_s=0),
                     IDENTITY) as reader:
        assert_all_from_l2(reader, 51)


@pytest.mark.valkey
def test_stores_share_blocks_through_valkey_and_a_new_store_sees_them(
        valkey_server: ValkeyServer) -> None:
    def tier() -> ValkeyTier:
        return ValkeyTier(ValkeyTierConfig(valkey_server.url), NAMESPACE, IDENTITY.manifest())

    first = tier()
    with TieredStore(StoreConfig(l1_bytes=64 * 1024**2), IDENTITY, l2_tier=first) as writer:
        write_through(writer, 52)
    first.close()
    second = tier()
    with TieredStore(StoreConfig(l1_bytes=0), IDENTITY, l2_tier=second) as reader:
        assert_all_from_l2(reader, 52)
    second.close()
    report = run_worker("read", f"valkey:{valkey_server.url}", "--seed", "52", "--count",
                        str(COUNT), "--bytes", str(256 * KIB))
    assert (report["hits"], report["misses"], report["mismatched"]) == (COUNT, 0, 0)
