"""The connector's worker side on CUDA tensors (vLLM 0.32's layout): its saver and loader
threads, pinned buffers and staging, between two replicas on one L2 directory. Skipped without
CUDA (CI has no GPU); `tests/gpu/conftest.py` says what stands in for vLLM where it is absent.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.core.tiers.base import Tier
from kvtier.vllm.metadata import KvtierMetadata, LoadSpec
from tests.helpers.worker_side import CHAIN, close_replica, replica, save_blocks, wait_loaded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_blocks_saved_on_one_gpu_replica_load_on_another_from_l2_then_from_l1(
    tmp_path: Path,
) -> None:
    a, a_caches = replica(tmp_path, "cuda")
    b, b_caches = replica(tmp_path, "cuda", load_read_threads=2)
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)

        # from L2 through the loader's pinned staging, before this step's forward pass
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        torch.cuda.synchronize()
        for name in a_caches:
            assert torch.equal(b_caches[name][1:4], a_caches[name][7:10])
        assert b.load_errors() == set()
        totals = b._counters.totals()
        assert totals["load_blocks_l2"] == 3 and totals["load_failed_blocks"] == 0
        assert totals.get("layered_copy_seconds", 0) == 0  # CUDA copies before the forward

        # promoted into L1 from the engine's copy, then an L1 hit (ordinary memory), async
        save_blocks(b, "hit", (1, 2, 3), promote=frozenset({0, 1, 2}))
        load = LoadSpec("again", CHAIN, (4, 5, 6), 0, (Tier.L1,) * 3, asynchronous=True)
        b.start_loads(KvtierMetadata(loads=[load]))
        wait_loaded(b, "again")
        torch.cuda.synchronize()
        for name in a_caches:
            assert torch.equal(b_caches[name][4:7], a_caches[name][7:10])
        assert b._counters.totals()["load_blocks_l1"] == 3
    finally:
        close_replica(a)
        close_replica(b)


def test_a_missing_block_fails_the_rest_of_the_load_on_cuda(tmp_path: Path) -> None:
    b, b_caches = replica(tmp_path, "cuda")
    before = {name: t.clone() for name, t in b_caches.items()}
    try:
        load = LoadSpec("miss", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        assert b.load_errors() == {1, 2, 3}
        torch.cuda.synchronize()
        assert all(torch.equal(b_caches[n], before[n]) for n in before)
    finally:
        close_replica(b)
