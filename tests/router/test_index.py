"""PrefixIndex: per-replica, per-tier prefix matching with LRU bounds and purges."""

from kvtier.core.keys import BlockHash, block_hashes
from kvtier.core.tiers.base import Tier
from kvtier.router.index import SHARED, PrefixIndex

CHAIN = block_hashes(list(range(40)), 4)  # 10 chained block hashes


def test_match_reports_each_replicas_longest_contiguous_prefix() -> None:
    index = PrefixIndex()
    index.insert("a", CHAIN[:3], Tier.L0, now=0.0)
    index.insert("b", CHAIN[:1], Tier.L1, now=0.0)
    index.insert("b", CHAIN[2:4], Tier.L0, now=0.0)  # a gap at block 1: not contiguous
    assert index.match(CHAIN) == {"a": [Tier.L0] * 3, "b": [Tier.L1]}


def test_best_tier_wins_and_removing_one_tier_keeps_the_other() -> None:
    index = PrefixIndex()
    index.insert("a", CHAIN[:2], Tier.L1, now=0.0)
    index.insert("a", CHAIN[:1], Tier.L0, now=0.0)
    assert index.match(CHAIN)["a"] == [Tier.L0, Tier.L1]
    index.remove("a", CHAIN[:1], Tier.L0)
    assert index.match(CHAIN)["a"] == [Tier.L1, Tier.L1]
    assert len(index) == 2


def test_shared_l2_blocks_count_for_every_replica_including_unknown_ones() -> None:
    index = PrefixIndex()
    index.insert(SHARED, CHAIN[:4], Tier.L2, now=0.0)
    index.insert("a", CHAIN[:2], Tier.L0, now=0.0)
    got = index.match(CHAIN, replicas=["a", "b"])
    assert got == {"a": [Tier.L0, Tier.L0, Tier.L2, Tier.L2], "b": [Tier.L2] * 4}


def test_lru_bound_evicts_the_least_recently_touched_entry() -> None:
    index = PrefixIndex(max_blocks=3)
    index.insert("a", CHAIN[:2], Tier.L0, now=1.0)
    index.insert("b", CHAIN[:1], Tier.L0, now=2.0)
    index.insert("a", CHAIN[:1], Tier.L0, now=3.0)  # touch a/0: a/1 is now the oldest
    index.insert("b", CHAIN[1:2], Tier.L0, now=4.0)
    assert len(index) == 3
    assert index.match(CHAIN) == {"a": [Tier.L0], "b": [Tier.L0, Tier.L0]}


def test_purge_forgets_one_replica_only() -> None:
    index = PrefixIndex()
    index.insert("a", CHAIN[:3], Tier.L0, now=0.0)
    index.insert("b", CHAIN[:3], Tier.L1, now=0.0)
    index.purge("a")
    assert index.match(CHAIN) == {"b": [Tier.L1] * 3}
    assert len(index) == 3
    assert index.replicas() == {"b"}


def test_remove_tier_clears_only_that_tier() -> None:
    index = PrefixIndex()
    index.insert("a", CHAIN[:2], Tier.L0, now=0.0)
    index.insert("a", CHAIN[:1], Tier.L1, now=0.0)
    index.remove_tier("a", Tier.L0)
    assert index.match(CHAIN) == {"a": [Tier.L1]}
    assert len(index) == 1


def test_expire_drops_entries_touched_before_the_cutoff() -> None:
    index = PrefixIndex()
    index.insert("a", CHAIN[:2], Tier.L0, now=1.0)
    index.insert("b", CHAIN[:2], Tier.L0, now=5.0)
    assert index.expire(before=3.0) == 2
    assert index.match(CHAIN) == {"b": [Tier.L0, Tier.L0]}


def test_match_continues_a_prefix_across_merged_indexes() -> None:
    events, speculative = PrefixIndex(), PrefixIndex()
    events.insert("a", CHAIN[:2], Tier.L1, now=0.0)
    speculative.insert("a", CHAIN[2:3], Tier.L0, now=0.0)
    assert events.match(CHAIN, also=(speculative,)) == {"a": [Tier.L1, Tier.L1, Tier.L0]}


def test_remove_tier_also_drops_the_replicas_guesses_in_that_tier() -> None:
    events, guesses = PrefixIndex(), PrefixIndex()
    events.supersede(guesses)
    events.insert("a", CHAIN[:1], Tier.L0, now=0.0)
    guesses.insert("a", CHAIN[:3], Tier.L0, now=0.0)  # routed, no event yet
    guesses.insert("b", CHAIN[:3], Tier.L0, now=0.0)
    events.remove_tier("a", Tier.L0)
    assert len(events) == 0
    assert guesses.match(CHAIN) == {"b": [Tier.L0] * 3}


def test_touch_keeps_a_read_prefix_and_refreshes_its_root_last() -> None:
    index = PrefixIndex(max_blocks=4)
    index.insert(SHARED, CHAIN[:1], Tier.L2, now=0.0)
    index.insert("a", CHAIN[:2], Tier.L0, now=1.0)
    index.insert("b", CHAIN[5:6], Tier.L0, now=2.0)
    index.touch("a", CHAIN[:3], now=3.0)  # block 2 is held by nobody: skipped
    index.insert("b", CHAIN[6:7], Tier.L0, now=4.0)  # evicts b/5, the least recently touched
    assert index.match(CHAIN, replicas=["c"]) == {
        "a": [Tier.L0] * 2,
        "b": [Tier.L2],
        "c": [Tier.L2],
    }
    index.insert("b", CHAIN[7:8], Tier.L0, now=5.0)  # evicts a/1: the leaf before the root
    assert index.match(CHAIN, replicas=["c"]) == {"a": [Tier.L0], "b": [Tier.L2], "c": [Tier.L2]}


def test_touch_refreshes_a_prefix_at_most_once_a_second() -> None:
    index = PrefixIndex(10)
    chain = [BlockHash(bytes([i]) * 16) for i in range(3)]
    index.insert("a", chain, Tier.L1, now=0.0)
    index.insert("b", [BlockHash(b"\xff" * 16)], Tier.L1, now=5.0)
    index.touch("a", chain, now=10.0)
    index.touch("a", chain[:1], now=10.5)  # within the second: left as it was
    assert list(index._lru.values()) == [5.0, 10.0, 10.0, 10.0]
    index.touch("a", chain[:1], now=11.0)
    assert list(index._lru.values())[-1] == 11.0
