"""Worker sides without vLLM's engine, for `tests/vllm/test_worker_side.py` (CPU) and
`tests/gpu` (CUDA): real paged KV tensors in vLLM 0.32's layout, real stores on one L2
directory, the steps vLLM would drive."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvtier.core.keys import block_hashes, root_hash
from kvtier.core.store import TieredStore
from kvtier.vllm.compat import EngineGeometry
from kvtier.vllm.metadata import KvtierMetadata, SaveSpec
from kvtier.vllm.process_store import HashAliases, ProcessStore, model_identity
from kvtier.vllm.settings import ConnectorSettings
from kvtier.vllm.stats import ConnectorCounters
from kvtier.vllm.worker_side import WorkerSide

LAYERS, BLOCKS, TOKENS, HEADS, HEAD = 3, 12, 4, 2, 8
CHAIN = tuple(block_hashes(list(range(3 * TOKENS)), TOKENS))
PARENTS = (root_hash(), *CHAIN[:-1])


def geometry(device: str = "cpu") -> EngineGeometry:
    return EngineGeometry(
        platform=device,
        engine_block_tokens=TOKENS,
        num_layers=LAYERS,
        kv_heads=HEADS,
        head_size=HEAD,
        dtype="float32",
        tp_size=1,
    )


def kv_caches(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random per-layer KV tensors, (engine blocks, KV heads, block tokens, 2 x head size)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {
        f"model.layers.{i}.attn": torch.randn(
            BLOCKS, HEADS, TOKENS, 2 * HEAD, generator=gen, device=device
        )
        for i in range(LAYERS)
    }


def replica(
    l2: Path, device: str = "cpu", **worker: object
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A worker side on `l2`; the layered copy on unless `worker` says otherwise (here the
    background threads share this process's cores, where it would be off by default)."""
    config = ConnectorSettings(l1_bytes=1 << 24, l2_path=str(l2))
    identity = model_identity(config, geometry(device), "model", 0)
    store = TieredStore(config.store_settings(), identity)
    shared = ProcessStore(identity.namespace(), store, HashAliases(), None)
    seed = len(str(l2)) + len(worker)
    worker.setdefault("load_layerwise", True)
    side = WorkerSide(shared, geometry(device), 0, TOKENS, 1, ConnectorCounters(), **worker)  # type: ignore[arg-type]
    caches = kv_caches(seed, device)
    side.register(caches)
    return side, caches


def save_blocks(
    side: WorkerSide,
    req: str,
    ids: tuple[int, ...],
    promote: frozenset[int] = frozenset(),
    timeout_s: float = 30.0,
    blocks: int = len(CHAIN),
) -> None:
    """Offer engine blocks `ids` as the first `blocks` blocks of `CHAIN`, and wait until the
    saver is done."""
    spec = SaveSpec(
        req, CHAIN[:blocks], PARENTS[:blocks], ids, first_index=0, reused_blocks=0, promote=promote
    )
    save_step(side, [spec], timeout_s)


def save_step(side: WorkerSide, specs: list[SaveSpec], timeout_s: float = 30.0) -> None:
    """One step's saves: submit `specs` and wait until the saver is done with every request."""
    side.submit_saves(KvtierMetadata(saves=specs))
    waiting = {spec.req_id for spec in specs}
    deadline = time.monotonic() + timeout_s
    while waiting:
        assert time.monotonic() < deadline, "save did not finish"
        waiting -= side.finished(waiting)[0] or set()
        time.sleep(0.01)


def wait_loaded(side: WorkerSide, req: str, timeout_s: float = 30.0) -> None:
    """Until the worker reports `req`'s asynchronous load finished."""
    deadline = time.monotonic() + timeout_s
    while (side.finished(set())[1] or set()) != {req}:
        assert time.monotonic() < deadline, "the load did not finish"
        time.sleep(0.01)


def close_replica(side: WorkerSide) -> None:
    side.close()
    side._store.close()
