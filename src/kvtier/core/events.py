"""KV events: which blocks a replica stored or dropped, in which tier.

Replicas (the kvtier connector) publish them; the router's precise index consumes them.
Hashes are kvtier's seedless chained hashes (`kvtier.core.keys`), so engine seeds never matter.
A replica announces a new `epoch` on every start: consumers purge what they knew of the
replica's older epoch (it restarted and its L0/L1 are empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import Tier


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    """The replica dropped everything it held in `tier` (hashes empty)."""


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: EventKind
    replica: str
    """Replica id as the router knows it (its base URL by default)."""
    epoch: str
    """Random id of the replica's current process lifetime."""
    tier: Tier
    hashes: tuple[BlockHash, ...]
    seq: int
    """Per-publisher sequence number; a gap means events were lost."""
    snapshot: bool = False
    """True for an event of a snapshot (the publisher's holdings as of `seq`, re-announced),
    False for a live one. Not encoded: the topic it arrives on says (`kvtier.net.kv_events`)."""
