"""Simulated tier caches: a capacity in blocks and an eviction policy.

Each cache is a small class with a `name`, looked up in `EVICTION`:

- `lru`: least recently used goes first; a hit or a re-admission refreshes the block. Chains
  are evicted tail-first, as kvtier's L1 (`kvtier.core.tiers.memory`) and vLLM's prefix cache
  evict them: a request's blocks are refreshed leaf first, root last, so a prefix is always more
  recent than its extensions, and a chain longer than the cache keeps its head (the blocks past
  the capacity are refused, never evicting their own prefix).
- `fifo`: first admitted goes first; hits do not refresh (cheap, scan-resistant-ish baseline).
- `janitor`: kvtier's shared L2 directory under its capacity janitor
  (`kvtier.core.tiers.janitor`): recency is set when a block is first written and refreshed by
  a read from this tier at most once per `JANITOR_TOUCH_S`; a block written again while held
  keeps its recency (the connector does not rewrite it), and so does one served from a faster
  tier. Above `JANITOR_HIGH` of the capacity the least recent blocks go, down to `JANITOR_LOW`.

Operations (called by the fleet simulator only, one thread):

- `block in cache`: membership, no side effect (the router-style lookup);
- `touch(block, now)`: the block was read (a hit) at simulated time `now` (seconds; only
  `janitor` reads it);
- `put(block, now)`: admit or refresh the block; returns the blocks evicted to make room
  (possibly the block itself when the capacity is 0), so the caller can publish removal events;
- `touch_chain(blocks, now)` / `put_chain(blocks, now)`: the same for a request's blocks, root
  first (a prefix chain); `put_chain` returns every block evicted, which may include blocks of
  the chain itself (never admitted for good);
- `discard(block)`: drop it if present.

Capacities count blocks of the trace; `math.inf` means unbounded. Keys are the trace's int ids
(cheaper than bytes in the hot loop).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Protocol

from kvtier.core.errors import ConfigError
from kvtier.core.settings import StoreSettings

__all__ = ["EVICTION", "BlockCache", "FIFOCache", "JanitorCache", "LRUCache", "make_cache"]

_DEFAULTS = StoreSettings.model_fields
JANITOR_TOUCH_S: float = _DEFAULTS["l2_touch_interval_s"].default
"""A read refreshes a block's recency at most this often (kvtier's default)."""
JANITOR_HIGH: float = _DEFAULTS["l2_high_watermark"].default
"""The fraction of capacity above which the janitor evicts (kvtier's default)."""
JANITOR_LOW: float = _DEFAULTS["l2_low_watermark"].default
"""The fraction it evicts down to (kvtier's default)."""


class BlockCache(Protocol):
    name: ClassVar[str]
    capacity: float

    def __contains__(self, block: object) -> bool: ...
    def __len__(self) -> int: ...
    def touch(self, block: int, now: float = 0.0) -> None: ...
    def put(self, block: int, now: float = 0.0) -> list[int]: ...
    def touch_chain(self, blocks: Sequence[int], now: float = 0.0) -> None: ...
    def put_chain(self, blocks: Sequence[int], now: float = 0.0) -> list[int]: ...
    def discard(self, block: int) -> None: ...


class _OrderedCache:
    """Shared machinery: an insertion-ordered dict whose first key is the next victim."""

    name: ClassVar[str]
    refresh_on_hit: ClassVar[bool]
    refresh_on_write: ClassVar[bool] = True
    """Whether `put` of a held block counts as a use (`touch`)."""
    evict_above: ClassVar[float] = 1.0
    evict_to: ClassVar[float] = 1.0
    """Eviction starts when the blocks exceed `evict_above` x capacity and goes on until they
    are at most `evict_to` x capacity."""

    def __init__(self, capacity: float) -> None:
        if not (capacity >= 0 and (math.isinf(capacity) or capacity == int(capacity))):
            raise ConfigError(
                f"capacity: must be a whole number of blocks >= 0 or inf, got {capacity}"
            )
        self.capacity = capacity
        self._blocks: OrderedDict[int, float] = OrderedDict()
        """Block -> when it was admitted or last refreshed; the first is the next victim."""

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, block: int, now: float = 0.0) -> None:
        if self.refresh_on_hit and block in self._blocks:
            self._blocks.move_to_end(block)
            self._blocks[block] = now

    def put(self, block: int, now: float = 0.0) -> list[int]:
        if block in self._blocks:
            if self.refresh_on_write:
                self.touch(block, now)
            return []
        self._blocks[block] = now
        return self._evict()

    def _evict(self) -> list[int]:
        """Make room per `evict_above`/`evict_to`, from the first key; returns the victims."""
        evicted: list[int] = []
        if len(self._blocks) > self.capacity * self.evict_above:
            while len(self._blocks) > self.capacity * self.evict_to:
                evicted.append(self._blocks.popitem(last=False)[0])
        return evicted

    def touch_chain(self, blocks: Sequence[int], now: float = 0.0) -> None:
        """`touch` each block, in chain order (root first)."""
        for block in blocks:
            self.touch(block, now)

    def put_chain(self, blocks: Sequence[int], now: float = 0.0) -> list[int]:
        """`put` each block, in chain order (root first); returns all the evictions."""
        evicted: list[int] = []
        for block in blocks:
            evicted += self.put(block, now)
        return evicted

    def discard(self, block: int) -> None:
        self._blocks.pop(block, None)


class LRUCache(_OrderedCache):
    """Tail-first LRU over chains (see the module docstring)."""

    name = "lru"
    refresh_on_hit = True

    def touch_chain(self, blocks: Sequence[int], now: float = 0.0) -> None:
        """Refresh the held blocks leaf first, so the root ends most recent."""
        held = self._blocks
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
                held[block] = now

    def put_chain(self, blocks: Sequence[int], now: float = 0.0) -> list[int]:
        """Admit or refresh the whole chain leaf first (root most recent), then evict the least
        recent: other chains' tails before this chain's, and this chain's leaves before its
        root. Returns the evicted blocks, this chain's refused leaves included."""
        held = self._blocks
        for block in reversed(blocks):
            held[block] = now
            held.move_to_end(block)
        return self._evict()


class FIFOCache(_OrderedCache):
    name = "fifo"
    refresh_on_hit = False


class JanitorCache(_OrderedCache):
    """kvtier's L2 directory as its janitor keeps it (see the module docstring)."""

    name = "janitor"
    refresh_on_hit = True
    refresh_on_write = False
    evict_above = JANITOR_HIGH
    evict_to = JANITOR_LOW

    def touch(self, block: int, now: float = 0.0) -> None:
        last = self._blocks.get(block)
        if last is not None and now - last >= JANITOR_TOUCH_S:
            super().touch(block, now)


EVICTION: dict[str, type[_OrderedCache]] = {
    LRUCache.name: LRUCache,
    FIFOCache.name: FIFOCache,
    JanitorCache.name: JanitorCache,
}


def make_cache(policy: str, capacity: float) -> BlockCache:
    try:
        cls = EVICTION[policy]
    except KeyError:
        raise ConfigError(
            f"eviction: unknown policy {policy!r}; choose from {', '.join(sorted(EVICTION))}"
        ) from None
    return cls(capacity)
