"""The replicas behind the router: health, load counters and the claims that keep them honest.

Every forwarded request holds a `LoadClaim` on its replica from routing to the end of the
response; the claim counts it in `in_flight` and its uncached prompt tokens in
`queued_prefill_tokens` until the first byte comes back. `ReplicaSet.claim` is a context
manager, so the counters are released on every path: success, upstream error, failover, client
disconnect, cancellation.

Progress: `last_progress` is when the replica last sent a byte of any answer (or when a request
found it idle), so `no_progress_s` is how long the requests it holds have waited for anything: a
replica whose engine hangs while its HTTP server answers /health (a gray failure) shows it
growing. The claims of a replica found stalled or unreachable are `abandon`ed: requests without
an answer yet fail over, streams under way end with an error event.

Owned by the router's event loop (single-threaded: no locks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Self

from kvtier.router.policies import ReplicaView
from kvtier.router.settings import ReplicaSettings

__all__ = ["LoadClaim", "Replica", "ReplicaSet"]


@dataclass(slots=True)
class Replica:
    settings: ReplicaSettings
    healthy: bool = True
    """False while down (health checks) or suspect (a forward just failed)."""
    failed_checks: int = 0
    queued_prefill_tokens: int = 0
    models: tuple[str, ...] = ()
    """Model ids its /v1/models lists (learned by the health checker)."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Those of `models` that are LoRA adapters (their card names a `parent`), with their paths
    (the card's `root`): requests for one are hashed with both, as vLLM and the connector key
    its blocks."""
    learned_at: float = 0.0
    """`time.monotonic()` when the health checker last read its models and block size."""
    max_model_len: int | None = None
    block_tokens: int | None = None
    """The engine's KV block size, read from its /metrics (learned by the health checker)."""
    draining: bool = False
    """Gone from discovery: no new requests; dropped once idle (`kvtier.router.discovery`)."""
    stalled: bool = False
    """Its requests made no progress and a probe request got no answer: out of rotation until a
    probe is answered (`kvtier.router.health`)."""
    stopping: bool = False
    """It refused a request as a stopping vLLM does while it drains (`kvtier.router.upstream`):
    out of rotation until it answers a probe completion or stops answering /health."""
    last_progress: float = 0.0
    """`time.monotonic()` of its last byte of an answer, or of a request that found it idle."""
    claims: set[LoadClaim] = field(default_factory=set)
    """The requests it holds."""

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def state(self) -> str:
        """What the dashboard and `kvtier status` show: stalled, stopping (it drains and refuses
        new requests), leaving (gone from discovery), down (failed checks, or a failed forward
        until its next good check), or up."""
        if self.stalled:
            return "stalled"
        if self.stopping:
            return "stopping"
        if self.draining:
            return "leaving"
        return "up" if self.healthy else "down"

    @property
    def in_flight(self) -> int:
        """Requests it holds, from routing to the end of their response."""
        return len(self.claims)

    def no_progress_s(self, now: float) -> float:
        """Seconds the requests it holds have waited for any byte from it (0 when idle)."""
        return now - self.last_progress if self.in_flight else 0.0

    def abandon_requests(self, reason: str) -> int:
        """It stalled, or cannot be reached: fail over every request it holds that has no byte
        of its answer yet, and end its streams under way with an error event naming `reason`;
        returns how many."""
        return sum(claim.abandon(reason) for claim in list(self.claims))

    def view(self, excluded: bool = False) -> ReplicaView:
        return ReplicaView(
            self.name,
            self.in_flight,
            self.queued_prefill_tokens,
            self.healthy and not self.draining and not excluded,
        )


class LoadClaim:
    """One request's claim on a replica's load counters; `release` is idempotent. `task` is
    the task forwarding the request (cancelled by `abandon`)."""

    __slots__ = ("_done", "_prefill", "abandoned", "answered", "relaying", "replica", "task")

    def __init__(
        self, replica: Replica, prefill_tokens: int, task: asyncio.Task[object] | None = None
    ) -> None:
        self.replica = replica
        self.task = task
        self._prefill = max(0, prefill_tokens)
        self._done = False
        self.answered = False
        self.relaying = False
        """A stream is being relayed to the client (committed: cut, not retried)."""
        self.abandoned: str | None = None
        """Why the health checker gave up on its replica (see `Replica.abandon_requests`)."""
        """`abandon` cancelled the task: the forward fails the request over."""
        if not replica.in_flight:
            replica.last_progress = time.monotonic()
        replica.claims.add(self)
        replica.queued_prefill_tokens += self._prefill

    def first_byte(self) -> None:
        """The replica answered: its prefill of this prompt is no longer queued."""
        self.answered = True
        self.progress()
        self._unqueue()

    def progress(self) -> None:
        """Another byte of the answer came."""
        self.replica.last_progress = time.monotonic()

    def abandon(self, reason: str) -> bool:
        """Cancel the forwarding task, before the answer or while relaying a stream (not while
        a whole answer is being sent); whether it did."""
        if self._done or self.task is None or (self.answered and not self.relaying):
            return False
        self.abandoned = reason
        self.task.cancel()
        return True

    def _unqueue(self) -> None:
        self.replica.queued_prefill_tokens -= self._prefill
        self._prefill = 0

    def release(self) -> None:
        if self._done:
            return
        self._unqueue()
        self.replica.claims.discard(self)
        self._done = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ReplicaSet:
    def __init__(self, replicas: tuple[ReplicaSettings, ...]) -> None:
        self.replicas = {r.name: Replica(r) for r in replicas}

    def __getitem__(self, name: str) -> Replica:
        return self.replicas[name]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas.values())

    def __len__(self) -> int:
        return len(self.replicas)

    def views(self, excluded: set[str]) -> list[ReplicaView]:
        return [r.view(r.name in excluded) for r in self.replicas.values()]

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy and not r.draining]

    def others_in_rotation(self, replica: Replica) -> bool:
        """Whether a replica other than `replica` is in rotation: the last one is never taken
        out for a suspicion (a stall, a failed connection), which would answer 503 to all."""
        return any(other is not replica for other in self.healthy())

    def add(self, settings: ReplicaSettings, healthy: bool = True) -> Replica:
        """A replica joins (discovery); `healthy=False` keeps it out until a good check."""
        replica = self.replicas[settings.name] = Replica(settings, healthy=healthy)
        return replica

    def remove(self, name: str) -> Replica | None:
        """A replica leaves; requests already holding it finish on their own."""
        return self.replicas.pop(name, None)

    def models(self) -> set[str]:
        return {m for r in self.replicas.values() for m in r.models}

    def adapter_path(self, model: str, replica: str | None = None) -> str | None:
        """The path of LoRA adapter `model` on `replica` (None: the first replica listing it);
        None when it is no adapter there (a dict lookup per replica)."""
        if replica is not None:
            one = self.replicas.get(replica)
            return None if one is None else one.adapters.get(model)
        paths = (r.adapters[model] for r in self.replicas.values() if model in r.adapters)
        return next(paths, None)

    def max_model_len(self) -> int | None:
        lens = [r.max_model_len for r in self.replicas.values() if r.max_model_len]
        return min(lens) if lens else None

    def block_tokens(self) -> int | None:
        """The engines' block size, as the replicas report it (the most common answer)."""
        sizes = [r.block_tokens for r in self.replicas.values() if r.block_tokens]
        return max(set(sizes), key=sizes.count) if sizes else None

    def claim(
        self, replica: Replica, prefill_tokens: int, task: asyncio.Task[object] | None = None
    ) -> LoadClaim:
        """Use as `with replicas.claim(...) as claim:` (released on leaving the block)."""
        return LoadClaim(replica, prefill_tokens, task)
