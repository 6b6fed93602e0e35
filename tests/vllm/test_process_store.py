"""The per-process runtime: one shared store per namespace, and KV events keyed by the engine
block hashes the router indexes (two per 256-token kvtier block)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from kvtier.core.codec import BlockMeta
from kvtier.core.events import EventKind
from kvtier.core.keys import ModelIdentity, block_hashes, root_hash
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import EventSubscriber
from kvtier.vllm import process_store
from kvtier.vllm.settings import ConnectorSettings


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _identity(rank: int = 0) -> ModelIdentity:
    return ModelIdentity(model="m", kv_layout="test", block_tokens=256, tp_size=2, tp_rank=rank)


def test_scheduler_and_worker_of_one_process_share_one_store_per_rank() -> None:
    config = ConnectorSettings(l1_bytes=1 << 20)
    worker = process_store.acquire(config, _identity(0), publish=False)
    scheduler = process_store.acquire(config, _identity(0), publish=False)
    other_rank = process_store.acquire(config, _identity(1), publish=False)
    try:
        assert scheduler.store is worker.store
        assert other_rank.store is not worker.store
    finally:
        for rt in (worker, scheduler, other_rank):
            process_store.release(rt)
    assert worker.users == 0


def test_stored_and_evicted_blocks_are_published_as_engine_block_hashes(tmp_path: Path) -> None:
    endpoint = _endpoint()
    payload = bytes(600_000)
    config = ConnectorSettings(l1_bytes=1_000_000, events_endpoint=endpoint, replica_id="r1")
    rt = process_store.acquire(config, _identity(), publish=True)
    # Two unrelated one-block prompts: L1 fits one, so the second evicts the first.
    prompts = [list(range(256)), list(range(1000, 1256))]
    kvtier_hashes = [block_hashes(p, 256)[0] for p in prompts]
    engine_hashes = [h for p in prompts for h in block_hashes(p, 128)]
    try:
        assert rt.publisher is not None
        with EventSubscriber([endpoint]) as sub:
            for i, h in enumerate(kvtier_hashes):
                rt.aliases.add(h, engine_hashes[2 * i : 2 * i + 2])
            time.sleep(0.5)  # let the subscription reach the publisher
            meta = BlockMeta(num_tokens=256, dtype="uint8", shape=(600_000,), parent=root_hash())
            rt.store.save(kvtier_hashes[0], meta, payload)
            rt.store.save(kvtier_hashes[1], meta, payload)
            events = []
            deadline = time.monotonic() + 10
            while len(events) < 3 and time.monotonic() < deadline:
                events += sub.drain(timeout_s=0.5)
    finally:
        process_store.release(rt)
    assert [(e.kind, e.tier, e.hashes) for e in events] == [
        (EventKind.STORED, Tier.L1, tuple(engine_hashes[0:2])),
        (EventKind.REMOVED, Tier.L1, tuple(engine_hashes[0:2])),
        (EventKind.STORED, Tier.L1, tuple(engine_hashes[2:4])),
    ]
    assert {e.replica for e in events} == {"r1"}
