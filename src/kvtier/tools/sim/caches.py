"""Simulated tier caches: a capacity in blocks and an eviction policy.

Each cache is a small class with a `name`, looked up in `EVICTION`:

- `lru`: least recently used goes first; a hit or a re-admission refreshes the block.
- `fifo`: first admitted goes first; hits do not refresh (cheap, scan-resistant-ish baseline).

Operations (called by the fleet simulator only, one thread):

- `block in cache`: membership, no side effect (the router-style lookup);
- `touch(block)`: the block was read (a hit);
- `put(block)`: admit or refresh the block; returns the blocks evicted to make room (possibly
  the block itself when the capacity is 0), so the caller can publish removal events;
- `discard(block)`: drop it if present.

Capacities count blocks of the trace; `math.inf` means unbounded. Keys are the trace's int ids
(cheaper than bytes in the hot loop).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import ClassVar, Protocol

from kvtier.core.errors import ConfigError

__all__ = ["EVICTION", "BlockCache", "FIFOCache", "LRUCache", "make_cache"]


class BlockCache(Protocol):
    name: ClassVar[str]
    capacity: float

    def __contains__(self, block: object) -> bool: ...
    def __len__(self) -> int: ...
    def touch(self, block: int) -> None: ...
    def put(self, block: int) -> list[int]: ...
    def discard(self, block: int) -> None: ...


class _OrderedCache:
    """Shared machinery: an insertion-ordered dict whose first key is the next victim."""

    name: ClassVar[str]
    refresh_on_hit: ClassVar[bool]

    def __init__(self, capacity: float) -> None:
        if not (capacity >= 0 and (math.isinf(capacity) or capacity == int(capacity))):
            raise ConfigError(
                f"capacity: must be a whole number of blocks >= 0 or inf, got {capacity}"
            )
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, block: int) -> None:
        if self.refresh_on_hit and block in self._blocks:
            self._blocks.move_to_end(block)

    def put(self, block: int) -> list[int]:
        if block in self._blocks:
            self.touch(block)
            return []
        self._blocks[block] = None
        evicted: list[int] = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted

    def discard(self, block: int) -> None:
        self._blocks.pop(block, None)


class LRUCache(_OrderedCache):
    name = "lru"
    refresh_on_hit = True


class FIFOCache(_OrderedCache):
    name = "fifo"
    refresh_on_hit = False


EVICTION: dict[str, type[_OrderedCache]] = {
    LRUCache.name: LRUCache,
    FIFOCache.name: FIFOCache,
}


def make_cache(policy: str, capacity: float) -> BlockCache:
    try:
        cls = EVICTION[policy]
    except KeyError:
        raise ConfigError(
            f"eviction: unknown policy {policy!r}; choose from {', '.join(sorted(EVICTION))}"
        ) from None
    return cls(capacity)
