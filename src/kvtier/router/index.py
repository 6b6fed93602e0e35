"""Per-replica prefix index: which blocks each replica holds, in which tier.

Operations (all pure, no I/O, no clock reads; `now` is passed in so the simulator replays the
exact code the router runs):

- `insert(replica, hashes, tier, now)`: the replica holds these blocks in `tier` (a KV event, or
  a speculative insert at route time). Touches the entries' LRU position.
- `remove(replica, hashes, tier)`: the replica dropped these blocks from `tier`.
- `remove_tier(replica, tier)`: the replica dropped everything it held in `tier` (a cleared
  cache, or the tier's process restarted); its guesses in that tier go too.
- `purge(replica)`: forget everything of a replica (it is gone).
- `touch(replica, hashes, now)`: a request routed to the replica reads these blocks: refresh the
  LRU position of its entries and of the shared pool's, root last (a cache hit sends no event).
- `match(hashes)`: per known replica, the best tier of each block of its longest contiguous
  cached prefix. A block held by the pseudo-replica `SHARED` (the shared L2 pool) counts as L2
  for every replica.
- `expire(before)`: drop entries last touched before `before` (speculative entries' TTL).
- `supersede(guesses)`: from now on, `insert` and `remove` here also drop the same replica's
  entries for the same blocks and tier from `guesses` (a policy's speculative index): a guess
  lasts until the replica's own events answer it, however long the request queues.

Memory is bounded: at most `max_blocks` (replica, block) entries; inserting beyond evicts the
least recently touched entry. An entry keeps a bit set of the tiers it is in, so an L0 eviction
leaves an L1 copy known. Events alone would order entries by when they were stored: a shared
system prompt stored once, then read by every request, would be the first evicted while the
leaves of its conversations stay, and every match would then end at block 0. `touch` on a
routed request keeps hot prefixes recent (O(1) per block: an `OrderedDict` move; a prefix at
most once a second), and refreshes a prefix leaf first, so its root is the last of it to go.

Callers: the router's policies (one event loop, so no locking) and the fleet simulator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import TIER_ORDER, Tier

__all__ = ["SHARED", "PrefixIndex"]

SHARED = "*"
"""Pseudo-replica holding L2 (shared pool) blocks: they count for every replica."""
TOUCH_EVERY_S = 1.0
"""How often `touch` refreshes one prefix at most."""

_BIT = {tier: 1 << i for i, tier in enumerate(TIER_ORDER)}


def _best(mask: int) -> Tier | None:
    for tier in TIER_ORDER:
        if mask & _BIT[tier]:
            return tier
    return None


_BEST_OF_MASK: tuple[Tier | None, ...] = tuple(_best(m) for m in range(1 << len(TIER_ORDER)))
"""`_best` of every tier bit set, looked up on the routing path instead of recomputed."""
_NO_HOLDERS: dict[str, int] = {}


def _union(masks: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Tier bits per replica of two indexes' entries for one block (new dict)."""
    merged = dict(masks)
    for r, m in more.items():
        merged[r] = merged.get(r, 0) | m
    return merged


class PrefixIndex:
    """Which blocks each replica holds, per tier; bounded by `max_blocks` entries (LRU)."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks <= 0:
            raise ConfigError(f"max_blocks: must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        # hash -> {replica: tier bit set}; what `match` walks.
        self._holders: dict[BlockHash, dict[str, int]] = {}
        # (replica, hash) -> last touch time, in LRU order (oldest first).
        self._lru: OrderedDict[tuple[str, BlockHash], float] = OrderedDict()
        # replica -> its hashes, so `purge` does not scan the whole index.
        self._by_replica: dict[str, set[BlockHash]] = {}
        # indexes of guesses that this index's entries answer (`supersede`)
        self._guesses: list[PrefixIndex] = []

    # ----- public API -----

    def supersede(self, guesses: PrefixIndex) -> None:
        """Let every `insert`/`remove` here drop the matching entries of `guesses`."""
        self._guesses.append(guesses)

    def insert(self, replica: str, hashes: Sequence[BlockHash], tier: Tier, now: float) -> None:
        for guesses in self._guesses:
            guesses.remove(replica, hashes, tier)
        bit = _BIT[tier]
        owned = self._by_replica.setdefault(replica, set())
        lru = self._lru
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = {}
            holders[replica] = holders.get(replica, 0) | bit
            owned.add(h)
            key = (replica, h)
            lru[key] = now
            lru.move_to_end(key)
        while len(self._lru) > self.max_blocks:
            (old_replica, old_hash), _ = self._lru.popitem(last=False)
            self._drop(old_replica, old_hash)

    def remove(self, replica: str, hashes: Sequence[BlockHash], tier: Tier) -> None:
        for guesses in self._guesses:
            guesses.remove(replica, hashes, tier)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and replica in holders:
                self._clear(replica, h, holders, _BIT[tier])

    def remove_tier(self, replica: str, tier: Tier) -> None:
        """The replica dropped everything it held in `tier` (a cleared cache, a restart of the
        process announcing that tier); its guesses in `tier` go too, whatever blocks they name."""
        for guesses in self._guesses:
            guesses.remove_tier(replica, tier)
        for h in list(self._by_replica.get(replica, ())):
            self._clear(replica, h, self._holders[h], _BIT[tier])

    def _clear(self, replica: str, h: BlockHash, holders: dict[str, int], bit: int) -> None:
        """Take tier `bit` off the replica's entry for `h`; the entry goes with its last tier."""
        mask = holders[replica] & ~bit
        if mask:
            holders[replica] = mask
        else:
            del self._lru[(replica, h)]
            self._drop(replica, h)

    def touch(self, replica: str, hashes: Sequence[BlockHash], now: float) -> None:
        """A request routed to `replica` reads the prefix `hashes`: refresh the LRU position
        of the replica's entries and the shared pool's for these blocks (absent ones are
        skipped), leaf first so the root ends most recent. A prefix whose root was refreshed
        less than `TOUCH_EVERY_S` ago is left as it is (one lookup: hot prefixes are routed
        over and over, and their order within that second does not matter)."""
        if not hashes:
            return
        lru = self._lru
        root = lru.get((replica, hashes[0]), lru.get((SHARED, hashes[0])))
        if root is not None and now - root < TOUCH_EVERY_S:
            return
        for h in reversed(hashes):
            for key in ((replica, h), (SHARED, h)):
                if key in lru:
                    lru[key] = now
                    lru.move_to_end(key)

    def purge(self, replica: str) -> None:
        for h in self._by_replica.pop(replica, set()):
            self._lru.pop((replica, h), None)
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._holders[h]

    def expire(self, before: float) -> int:
        """Drop entries last touched before `before`; returns how many."""
        dropped = 0
        while self._lru:
            (replica, h), touched = next(iter(self._lru.items()))
            if touched >= before:
                break
            self._lru.popitem(last=False)
            self._drop(replica, h)
            dropped += 1
        return dropped

    def match(
        self,
        hashes: Sequence[BlockHash],
        also: Iterable[PrefixIndex] = (),
        replicas: Iterable[str] = (),
    ) -> dict[str, list[Tier]]:
        """Best tier of each block of every known replica's longest contiguous cached prefix.

        `also` merges other indexes into the walk (e.g. a policy's speculative entries beside the
        event-fed index), so a prefix may continue across them. `replicas` adds replicas the
        indexes may not know yet (they still get shared L2 blocks). Replicas holding no leading
        block map to an empty list.

        The walk visits, per block, only the replicas holding that block themselves (usually
        one or two): every other replica's prefix is the shared pool's, the same for all.
        """
        indexes = (self, *also)
        first = self._holders
        others = [ix._holders for ix in also]
        known = set(replicas)
        for ix in indexes:
            known.update(ix._by_replica)
        known.discard(SHARED)
        l2, l2_bit, best = Tier.L2, _BIT[Tier.L2], _BEST_OF_MASK
        # Replicas still matching that hold blocks of this prefix themselves; a list shorter
        # than the blocks walked rides the shared pool since its end (L2, padded lazily).
        own: dict[str, list[Tier]] = {}
        ended: dict[str, list[Tier]] = {}
        pooled = 0  # leading blocks the shared pool holds: every other replica's prefix
        walked = 0
        for i, h in enumerate(hashes):
            masks = first.get(h, _NO_HOLDERS)
            for other in others:
                found = other.get(h)
                if found:
                    masks = _union(masks, found) if masks else found
            walked = i + 1
            if own and masks.keys() == own.keys():  # the same holders as the last block
                for r, prefix in own.items():
                    if len(prefix) < i:
                        prefix.extend([l2] * (i - len(prefix)))
                    prefix.append(best[masks[r]] or l2)
                continue
            if masks.get(SHARED, 0) & l2_bit:  # the pool holds it: nobody's prefix ends here
                for r, mask in masks.items():
                    tiers = own.get(r)
                    if tiers is None:
                        if r == SHARED or r in ended or pooled != i:
                            continue  # not a replica, or its prefix ended before this block
                        tiers = own[r] = []
                    if len(tiers) < i:
                        tiers.extend([l2] * (i - len(tiers)))
                    tiers.append(best[mask] or l2)
                if pooled == i:
                    pooled = walked
                continue
            holding: dict[str, list[Tier]] = {}
            for r, mask in masks.items():
                tiers = own.get(r)
                if tiers is None:
                    if r == SHARED or r in ended or pooled != i:
                        continue
                    tiers = []
                if len(tiers) < i:
                    tiers.extend([l2] * (i - len(tiers)))
                tiers.append(best[mask] or l2)
                holding[r] = tiers
            for r, tiers in own.items():  # the pool lacks this block: riders end here
                if r not in holding:
                    tiers.extend([l2] * (i - len(tiers)))
                    ended[r] = tiers
            own = holding
            if not own:
                break
        for tiers in own.values():
            tiers.extend([l2] * (walked - len(tiers)))
        result = {r: [l2] * pooled for r in known}
        result.update(ended)
        result.update(own)
        return result

    def replicas(self) -> set[str]:
        """Replicas (and possibly `SHARED`) holding at least one entry."""
        return {r for r, hs in self._by_replica.items() if hs}

    def __len__(self) -> int:
        return len(self._lru)

    # ----- internal helpers -----

    def _drop(self, replica: str, h: BlockHash) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._holders[h]
        owned = self._by_replica.get(replica)
        if owned is not None:
            owned.discard(h)
            if not owned:
                del self._by_replica[replica]
