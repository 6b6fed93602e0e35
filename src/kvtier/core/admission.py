"""Admission policies: which saved blocks the store keeps (in L1 and, through it, in L2).

Each policy is a small class with a `name` and one decision, `admit`, called by
`TieredStore.save` on the saving thread for every block; it must be cheap and free of I/O.
`make_policy(config)` looks the configured name up in `POLICIES`.

    always      keep everything.
    min-tokens  keep a block only when the prefix it ends is at least `admission_min_tokens`
                tokens long (short prompts are cheap to recompute and rarely shared).
    reused      keep a block the second time it is saved, or at once when the caller says its
                prefix was already reused; a bounded "seen once" set (a TinyLFU-style doorkeeper)
                keeps one-off prompts out of both tiers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ClassVar, Protocol

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash
from kvtier.core.lru import Lru
from kvtier.core.settings import AdmissionName, StoreSettings


class AdmissionPolicy(Protocol):
    name: ClassVar[AdmissionName]

    def admit(
        self, block_hash: BlockHash, meta: BlockMeta, *, reused: bool, prefix_tokens: int | None
    ) -> bool:
        """Whether to keep this block; `prefix_tokens` counts tokens up to its end (or None)."""
        ...


class AlwaysAdmit:
    name: ClassVar[AdmissionName] = "always"

    def admit(
        self, block_hash: BlockHash, meta: BlockMeta, *, reused: bool, prefix_tokens: int | None
    ) -> bool:
        return True


class MinTokensAdmit:
    name: ClassVar[AdmissionName] = "min-tokens"

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = min_tokens

    def admit(
        self, block_hash: BlockHash, meta: BlockMeta, *, reused: bool, prefix_tokens: int | None
    ) -> bool:
        tokens = meta.num_tokens if prefix_tokens is None else prefix_tokens
        return tokens >= self.min_tokens


class ReusedAdmit:
    name: ClassVar[AdmissionName] = "reused"

    def __init__(self, remember: int = 1 << 16) -> None:
        self._seen: Lru[BlockHash, bool] = Lru(remember)
        self._lock = threading.Lock()

    def admit(
        self, block_hash: BlockHash, meta: BlockMeta, *, reused: bool, prefix_tokens: int | None
    ) -> bool:
        with self._lock:
            if reused or block_hash in self._seen:
                self._seen.pop(block_hash)
                return True
            self._seen.put(block_hash, True)
            return False


POLICIES: dict[AdmissionName, Callable[[StoreSettings], AdmissionPolicy]] = {
    AlwaysAdmit.name: lambda config: AlwaysAdmit(),
    MinTokensAdmit.name: lambda config: MinTokensAdmit(config.admission_min_tokens),
    ReusedAdmit.name: lambda config: ReusedAdmit(),
}


def make_policy(config: StoreSettings) -> AdmissionPolicy:
    """The policy `config.admission` names (validated by `StoreSettings`)."""
    return POLICIES[config.admission](config)
