"""What a replica holds, as its own KV events said: the state a publisher re-announces.

A router that starts (or restarts, or reconnects) after a replica stored its blocks hears of
them only if the replica tells it again. `Holdings` follows the events one publisher sends
(stored, removed, cleared per tier) and gives them back as a snapshot of stored-events.

Bounded: at most `max_blocks` hashes per tier, the least recently stored dropped first (the
router's index is a hint; a block missing from it costs a colder routing choice, never a wrong
answer). A tier that dropped a hash so is `complete` no more until its next cleared-event: its
listing no longer names everything the replica holds there. L2 holdings are the blocks this
replica stored in the shared pool; another replica's janitor may since have removed some, which
the router then finds missing when it looks.

Pure (no I/O, no locks): the publisher's sender thread owns it.
"""

from __future__ import annotations

from kvtier.core.errors import ConfigError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import BlockHash
from kvtier.core.lru import Lru
from kvtier.core.tiers.base import TIER_ORDER, Tier

__all__ = ["Holdings"]


class Holdings:
    """Per tier, the hashes a replica's events left stored, oldest first; bounded per tier."""

    def __init__(self, max_blocks: int = 100_000) -> None:
        if max_blocks <= 0:
            raise ConfigError(f"max_held_blocks: must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._tiers: dict[Tier, Lru[BlockHash, bool]] = {}
        self._cut: set[Tier] = set()
        """Tiers that dropped a hash for room since their last cleared-event."""

    def apply(self, event: KVEvent) -> None:
        held = self._tiers.get(event.tier)
        if held is None:
            held = self._tiers[event.tier] = Lru(self.max_blocks)
        if event.kind is EventKind.STORED:
            for h in event.hashes:
                if h not in held and len(held) >= self.max_blocks:
                    self._cut.add(event.tier)
                held.put(h, True)
        elif event.kind is EventKind.REMOVED:
            for h in event.hashes:
                held.pop(h)
        else:
            held.clear()
            self._cut.discard(event.tier)

    def complete(self, tier: Tier) -> bool:
        """Whether the listing of `tier` names every hash its events left stored (none was
        dropped for room since its last cleared-event)."""
        return tier not in self._cut

    def mark_incomplete(self) -> None:
        """Take every tier's listing as incomplete (events went unrecorded)."""
        self._cut |= set(TIER_ORDER)

    def __len__(self) -> int:
        return sum(len(held) for held in self._tiers.values())

    def snapshot(self, chunk: int) -> list[tuple[Tier, tuple[BlockHash, ...]]]:
        """(tier, up to `chunk` hashes) batches covering every held block, oldest first within
        a tier, so that replaying them as stored-events leaves the newest most recent."""
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        batches = []
        for tier in TIER_ORDER:
            hashes = tuple(self._tiers.get(tier, ()))
            batches += [(tier, hashes[i : i + chunk]) for i in range(0, len(hashes), chunk)]
        return batches
