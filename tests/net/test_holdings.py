"""What a publisher re-announces: the blocks its own events left stored, per tier, bounded."""

from __future__ import annotations

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import block_hashes
from kvtier.core.tiers.base import Tier
from kvtier.net.holdings import Holdings

H = tuple(block_hashes(list(range(128 * 6)), 128))


def ev(kind: EventKind, tier: Tier, hashes: tuple = ()) -> KVEvent:
    return KVEvent(kind, "r", "e", tier, hashes, 0)


def test_stored_removed_and_cleared_leave_what_is_held_per_tier() -> None:
    held = Holdings()
    held.apply(ev(EventKind.STORED, Tier.L1, H[:4]))
    held.apply(ev(EventKind.STORED, Tier.L2, H[:2]))
    held.apply(ev(EventKind.REMOVED, Tier.L1, H[1:2]))
    assert held.snapshot(10) == [(Tier.L1, (H[0], H[2], H[3])), (Tier.L2, H[:2])]
    held.apply(ev(EventKind.CLEARED, Tier.L1))
    assert held.snapshot(10) == [(Tier.L2, H[:2])]
    assert len(held) == 2


def test_snapshot_is_chunked_oldest_first_and_a_restore_counts_as_newest() -> None:
    held = Holdings()
    held.apply(ev(EventKind.STORED, Tier.L1, H[:5]))
    held.apply(ev(EventKind.STORED, Tier.L1, H[1:2]))  # stored again: now the newest
    assert held.snapshot(2) == [
        (Tier.L1, (H[0], H[2])),
        (Tier.L1, (H[3], H[4])),
        (Tier.L1, (H[1],)),
    ]


def test_the_bound_drops_the_least_recently_stored_first() -> None:
    held = Holdings(max_blocks=3)
    held.apply(ev(EventKind.STORED, Tier.L2, H[:3]))
    held.apply(ev(EventKind.STORED, Tier.L2, H[0:1]))
    held.apply(ev(EventKind.STORED, Tier.L2, H[3:5]))
    assert held.snapshot(10) == [(Tier.L2, (H[0], H[3], H[4]))]


def test_a_bound_that_holds_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_held_blocks"):
        Holdings(max_blocks=0)


def test_a_tier_that_dropped_a_hash_for_room_is_incomplete_until_cleared() -> None:
    held = Holdings(max_blocks=3)
    held.apply(ev(EventKind.STORED, Tier.L1, H[:3]))
    held.apply(ev(EventKind.STORED, Tier.L1, H[1:2]))  # stored again: nothing dropped
    assert held.complete(Tier.L1)
    held.apply(ev(EventKind.STORED, Tier.L1, H[3:4]))  # H[0] dropped for room
    held.apply(ev(EventKind.REMOVED, Tier.L1, H[3:4]))  # under the bound again, still cut
    assert not held.complete(Tier.L1) and held.complete(Tier.L2)
    held.apply(ev(EventKind.CLEARED, Tier.L1))
    assert held.complete(Tier.L1)
    held.mark_incomplete()
    assert not held.complete(Tier.L1) and not held.complete(Tier.L2)
