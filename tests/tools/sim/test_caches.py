"""Tier caches: exact eviction order of LRU and FIFO, zero and unbounded capacity."""

from __future__ import annotations

import math

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tools.sim.caches import make_cache


def test_lru_evicts_least_recently_used_and_a_touch_refreshes() -> None:
    cache = make_cache("lru", 3)
    assert [cache.put(b) for b in (1, 2, 3)] == [[], [], []]
    cache.touch(1)
    assert cache.put(4) == [2]
    assert cache.put(3) == []  # refresh, no eviction
    assert cache.put(5) == [1]
    assert sorted(b for b in (1, 2, 3, 4, 5) if b in cache) == [3, 4, 5]


def test_lru_evicts_chains_tail_first_and_keeps_the_root_of_a_long_chain() -> None:
    """As kvtier's L1 orders a chain (`MemoryTier._touch_chain`): root most recent."""
    cache = make_cache("lru", 4)
    assert cache.put_chain([1, 2]) == []
    assert cache.put_chain([10, 11, 12]) == [2]  # the other chain's leaf, not its root
    cache.touch_chain([1])
    assert cache.put_chain([20]) == [12]
    assert cache.put_chain([30, 31, 32, 33, 34, 35]) == [11, 10, 1, 20, 35, 34]
    assert [b for b in range(40) if b in cache] == [30, 31, 32, 33]
    cache.touch_chain([30, 31])
    assert cache.put_chain([40]) == [33]


def test_fifo_ignores_hits_and_evicts_first_admitted() -> None:
    cache = make_cache("fifo", 2)
    cache.put(1)
    cache.put(2)
    cache.touch(1)
    assert cache.put(1) == []
    assert cache.put(3) == [1]
    assert 2 in cache and 3 in cache and len(cache) == 2


def test_zero_capacity_evicts_the_block_it_was_given() -> None:
    cache = make_cache("lru", 0)
    assert cache.put(7) == [7]
    assert 7 not in cache and len(cache) == 0


def test_infinite_capacity_never_evicts() -> None:
    cache = make_cache("lru", math.inf)
    assert all(cache.put(b) == [] for b in range(10_000))
    assert len(cache) == 10_000


def test_discard_removes_a_block() -> None:
    cache = make_cache("lru", 2)
    cache.put(1)
    cache.discard(1)
    cache.discard(99)
    assert 1 not in cache


@pytest.mark.parametrize(
    "policy, capacity, message",
    [
        ("lfu", 1, "unknown policy 'lfu'"),
        ("lru", -1, "capacity"),
        ("lru", 2.5, "capacity"),
    ],
)
def test_bad_settings_are_config_errors(policy: str, capacity: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_cache(policy, capacity)


def test_janitor_keeps_recency_from_writes_and_throttled_l2_reads_only() -> None:
    """kvtier's L2: a block written again, or served elsewhere, keeps its recency; a read
    refreshes it once `JANITOR_TOUCH_S` has passed; above the high watermark (9 of 10) the
    least recent go down to the low one (7.5 of 10: 7 kept)."""
    cache = make_cache("janitor", 10)
    for b in range(9):
        assert cache.put(b, now=float(b)) == []
    assert cache.put(0, now=100.0) == []  # held: no rewrite, no refresh
    cache.touch(1, now=30.0)  # read 29 s after its write: too soon to refresh
    cache.touch(2, now=62.5)  # 60.5 s after: refreshed
    assert cache.put(9, now=70.0) == [0, 1, 3]
    assert sorted(b for b in range(10) if b in cache) == [2, 4, 5, 6, 7, 8, 9]
    assert cache.put(10, now=71.0) == [] and len(cache) == 8
