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
