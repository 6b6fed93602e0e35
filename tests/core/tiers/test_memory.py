"""L1 memory tier: budget, exact LRU order with prefix-aware touches, copies and views."""

from __future__ import annotations

import random

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.keys import root_hash
from kvtier.core.tiers.base import PutResult, StoredBlock
from kvtier.core.tiers.memory import MemoryTier
from tests.helpers.tiers import hash_of, meta_for, payload_for


def put(tier: MemoryTier, name: str, nbytes: int = 100, parent: str | None = None) -> PutResult:
    h = hash_of(name)
    return tier.put(
        h, meta_for(nbytes, hash_of(parent) if parent else None), payload_for(h, nbytes)
    )


def names(tier: MemoryTier, *candidates: str) -> list[str]:
    by_hash = {hash_of(n): n for n in candidates}
    return [by_hash[h] for h in tier.order()]


def test_rejects_non_positive_budget() -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        MemoryTier(0)


def test_lru_evicts_least_recently_used_first() -> None:
    tier = MemoryTier(300)
    for n in "abc":
        assert put(tier, n).stored
    assert tier.get(hash_of("a")) is not None  # a becomes most recent: order b, c, a
    result = put(tier, "d")
    assert result.evicted == (hash_of("b"),)
    assert names(tier, *"abcd") == ["c", "a", "d"]
    result = put(tier, "e", nbytes=200)  # needs two slots: c then a go, oldest first
    assert result.evicted == (hash_of("c"), hash_of("a"))
    assert names(tier, *"abcde") == ["d", "e"]
    assert tier.stats().evicted == 3


def test_contains_and_peek_do_not_change_order() -> None:
    tier = MemoryTier(300)
    for n in "abc":
        put(tier, n)
    assert tier.contains(hash_of("a"))
    assert tier.peek(hash_of("a")) is not None
    assert names(tier, *"abc") == ["a", "b", "c"]
    assert tier.stats().hits == 0


def test_chain_is_evicted_from_its_tail() -> None:
    """Saving r -> x -> y leaves the root most recent, so pressure evicts y, then x, then r."""
    tier = MemoryTier(400)
    put(tier, "r")
    put(tier, "x", parent="r")
    put(tier, "y", parent="x")
    assert names(tier, "r", "x", "y") == ["y", "x", "r"]
    put(tier, "z")
    assert names(tier, *"rxyz") == ["y", "x", "r", "z"]
    assert put(tier, "w").evicted == (hash_of("y"),)
    assert put(tier, "v").evicted == (hash_of("x"),)
    assert put(tier, "u").evicted == (hash_of("r"),)


def test_hit_on_a_leaf_refreshes_its_ancestors() -> None:
    tier = MemoryTier(500)
    put(tier, "r")
    put(tier, "x", parent="r")
    put(tier, "a")
    put(tier, "b")
    assert names(tier, "r", "x", "a", "b") == ["x", "r", "a", "b"]
    tier.get(hash_of("x"))
    assert names(tier, "r", "x", "a", "b") == ["a", "b", "x", "r"]


def test_leaf_is_refused_when_its_ancestors_fill_the_budget() -> None:
    tier = MemoryTier(300)
    put(tier, "r")
    put(tier, "x", parent="r")
    put(tier, "y", parent="x")
    result = put(tier, "z", parent="y")
    assert not result.stored and result.evicted == ()
    assert names(tier, *"rxyz") == ["y", "x", "r"]
    assert tier.stats().rejected == 1


def test_block_larger_than_budget_is_refused_without_evicting() -> None:
    tier = MemoryTier(300)
    put(tier, "a")
    result = put(tier, "huge", nbytes=301)
    assert not result.stored and result.evicted == ()
    assert names(tier, "a") == ["a"]
    assert tier.stats().rejected == 1


def test_repeated_put_is_not_stored_twice() -> None:
    tier = MemoryTier(300)
    assert put(tier, "a").stored
    assert not put(tier, "a").stored
    stats = tier.stats()
    assert (stats.stored, stats.already_present, stats.used_bytes) == (1, 1, 100)


def test_put_copies_the_payload() -> None:
    tier = MemoryTier(300)
    source = bytearray(b"x" * 100)
    tier.put(hash_of("a"), meta_for(100), source)
    source[:] = b"y" * 100
    block = tier.get(hash_of("a"))
    assert block is not None and bytes(block.payload) == b"x" * 100
    assert block.payload.readonly


def test_views_stay_valid_after_eviction() -> None:
    tier = MemoryTier(100)
    put(tier, "a")
    view = tier.get(hash_of("a"))
    assert view is not None
    put(tier, "b")
    assert not tier.contains(hash_of("a"))
    assert bytes(view.payload) == payload_for(hash_of("a"), 100)


def test_adopt_charges_the_whole_underlying_buffer() -> None:
    tier = MemoryTier(1000)
    buffer = bytes(600)
    block = StoredBlock(meta_for(100), memoryview(buffer)[500:])
    assert tier.adopt(hash_of("a"), block).stored
    assert tier.used_bytes == 600
    with pytest.raises(ValueError, match="read-only"):
        tier.adopt(hash_of("b"), StoredBlock(meta_for(1), memoryview(bytearray(1))))


def test_budget_is_never_exceeded_under_random_workload() -> None:
    rng = random.Random(20261202)
    capacity = 10_000
    tier = MemoryTier(capacity)
    live: dict[bytes, int] = {}
    for step in range(5_000):
        name = f"b{rng.randrange(300)}"
        h = hash_of(name)
        op = rng.random()
        if op < 0.5:
            nbytes = rng.randrange(1, 3_000)
            parent = hash_of(f"b{rng.randrange(300)}") if rng.random() < 0.5 else root_hash()
            result = tier.put(h, meta_for(nbytes, parent), bytes(nbytes))
            if result.stored:
                live[h] = nbytes
            for gone in result.evicted:
                del live[gone]
        elif op < 0.8:
            block = tier.get(h)
            assert (block is not None) == (h in live)
        else:
            if tier.remove(h):
                del live[h]
        assert tier.used_bytes == sum(live.values()) <= capacity, f"step {step}"
        assert set(tier.order()) == set(live)
    stats = tier.stats()
    assert stats.used_bytes <= capacity and stats.objects == len(live)


def test_a_chain_longer_than_the_budget_keeps_its_head_block_after_block() -> None:
    """Saved in order, the blocks past the budget are refused one after the other: the block
    after a refused one does not evict the head as if it started a chain of its own."""
    tier = MemoryTier(300)
    chain = [f"b{i}" for i in range(10)]
    for parent, name in zip([None, *chain], chain, strict=False):
        put(tier, name, parent=parent)
    assert sorted(names(tier, *chain)) == ["b0", "b1", "b2"]
    assert tier.stats().rejected == 7 and tier.stats().evicted == 0
