"""`Lru`: a mapping that keeps its most recently used entries within a budget.

Every bounded memo and index in kvtier uses it: the store's recent L2 confirmations, the
admission doorkeeper, the POSIX tier's existence cache, the connector's hash aliases, the
router's tokenizer memos, sticky sessions and vLLM-hash names.

The budget counts entries by default; `cost(key, value)` weighs them otherwise (a memoized
prompt head costs its length). An entry costing more than the whole budget is not kept.
`get` and `put` make an entry the most recent; `peek` and `in` do not. Not thread-safe: an
owner that shares one across threads holds its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Lru"]

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A budgeted mapping from keys to values, least recently used evicted first."""

    __slots__ = ("_cost", "_items", "_spent", "budget")

    def __init__(self, budget: int, cost: Callable[[K, V], int] | None = None) -> None:
        if budget <= 0:
            raise ValueError(f"budget: must be positive, got {budget}")
        self.budget = budget
        self._cost = cost
        self._spent = 0
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value, now the most recent; None when absent."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value without touching its recency."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> V:
        """Store `value` as the most recent entry (replacing any) and return it; evicts the
        least recent entries beyond the budget."""
        cost = 1 if self._cost is None else self._cost(key, value)
        old = self._items.pop(key, None)
        if old is not None:
            self._spent -= 1 if self._cost is None else self._cost(key, old)
        if cost > self.budget:
            return value
        self._items[key] = value
        self._spent += cost
        while self._spent > self.budget:
            old_key, old_value = self._items.popitem(last=False)
            self._spent -= 1 if self._cost is None else self._cost(old_key, old_value)
        return value

    def pop(self, key: K) -> V | None:
        """Remove and return the value; None when absent."""
        value = self._items.pop(key, None)
        if value is not None:
            self._spent -= 1 if self._cost is None else self._cost(key, value)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._spent = 0

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recently used."""
        return iter(self._items)
