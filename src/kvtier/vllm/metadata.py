"""What the scheduler-side connector and the workers tell each other each step (pickled across
processes).

`KvtierMetadata` is built once per step by `SchedulerSide.build_meta` on the scheduler thread
and read by `WorkerSide` in every worker. `KvtierWorkerMeta` goes back: each worker's L1
changes, aggregated over workers by vLLM, applied by `SchedulerSide.apply_worker_meta`.
Engine block ids are the request's own blocks in vLLM's paged cache: they stay allocated to the
request until the worker reports the transfer finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtier.core.keys import BlockHash
from kvtier.core.tiers.base import Tier
from kvtier.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata
from kvtier.vllm.process_store import L1Change


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load `hashes` (consecutive kvtier blocks) of one request into its engine blocks."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    engine_block_ids: tuple[int, ...]
    """Destinations, `per_block` per kvtier block, minus the `skip` leading ones."""
    skip: int
    """Leading engine blocks of the first kvtier block already computed locally (kept)."""
    tiers: tuple[Tier, ...]
    """Where the lookup found each block (stats only; the load may find it elsewhere)."""
    engine_hashes: tuple[BlockHash, ...] = ()
    """Engine-block hashes of the loaded blocks, `per_block` per block (events; may be empty)."""
    asynchronous: bool = True
    """True: vLLM waits for `get_finished`; False: the load must finish before this step's
    forward pass."""
    planned_at: float | None = None
    """`time.monotonic()` when the scheduler planned the load (the worker times the wait until
    it starts: one machine's clock, comparable across its processes)."""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Offer the consecutive full kvtier blocks `hashes` of one request to the store."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    parents: tuple[BlockHash, ...]
    engine_block_ids: tuple[int, ...]
    """Sources, `per_block` per kvtier block."""
    first_index: int
    """Index of `hashes[0]` in the request's chain (prefix length for admission)."""
    reused_blocks: int
    """How many of the leading blocks of this request were cache hits (admission hint)."""
    engine_hashes: tuple[BlockHash, ...] = ()
    promote: frozenset[int] = frozenset()
    """Positions in `hashes` of blocks this request loaded from L2: saved into L1 although L2
    holds them (the promotion the load left out of its critical path)."""
    loaded_before: frozenset[int] = frozenset()
    """Engine blocks of the request before `hashes[0]` that a synchronous load (its own or
    another request's) wrote in one of the last `batches_in_flight` steps: the KV of every
    block offered here was computed from them, so none may be saved if one failed to load."""

    def head(self, n: int, per_block: int) -> SaveSpec:
        """The same offer for its first `n` blocks only."""
        return replace(
            self,
            hashes=self.hashes[:n],
            parents=self.parents[:n],
            engine_block_ids=self.engine_block_ids[: n * per_block],
            engine_hashes=self.engine_hashes[: n * per_block],
            promote=frozenset(i for i in self.promote if i < n),
        )


@dataclass(slots=True)
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()
    """Requests preempted this step: their blocks are freed, so their saves must stop reading
    them first."""


@dataclass(slots=True)
class KvtierWorkerMeta(KVConnectorWorkerMetadata):
    """L1 changes of the workers since their last report, tagged with the TP rank."""

    changes: list[tuple[int, L1Change]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMeta:
        if isinstance(other, KvtierWorkerMeta):
            self.changes += other.changes
        return self
