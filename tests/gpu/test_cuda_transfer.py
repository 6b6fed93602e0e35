"""The connector's CUDA data path on a real GPU: `PagedKV` over CUDA tensors in vLLM 0.32's
layout, through a real `TieredStore` (L1 and an L2 directory), between two "replicas".

Skipped without CUDA (CI has no GPU); run on a GPU machine with `pytest tests/gpu`. vLLM's CUDA
build is not needed: the tensors have the shape its FlashAttention and Triton backends register
(engine blocks, KV heads, block tokens, 2 x head size), which the connector's CPU engine tests
prove for the engine side.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import ModelIdentity, block_hashes, root_hash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import LoadedBlock, TieredStore
from kvtier.core.tiers.base import Tier
from kvtier.vllm.transfer import PagedKV, host_bytes, payload_view

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, ENGINE_BLOCKS, HEADS, TOKENS, HEAD = 4, 64, 8, 16, 128
PER_BLOCK = 4  # 64-token kvtier blocks
IDENTITY = ModelIdentity(model="cuda-transfer-test", block_tokens=TOKENS * PER_BLOCK)
CHAIN = block_hashes(list(range(3 * TOKENS * PER_BLOCK)), TOKENS * PER_BLOCK)


def _caches(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (ENGINE_BLOCKS, HEADS, TOKENS, 2 * HEAD)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen, device="cuda").to(
            torch.bfloat16
        )
        for i in range(LAYERS)
    }


def _blocks(kv: PagedKV, ids: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(ids, device="cuda")
    return [t.index_select(0, index) for t in kv.layers]


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-staging", "ordinary-memory"])
def test_blocks_saved_on_one_gpu_replica_load_byte_for_byte_into_another(
    tmp_path: Path, pinned: bool
) -> None:
    writer = PagedKV(_caches(seed=1), PER_BLOCK)
    assert writer.device.type == "cuda"
    sources = [[5, 9, 2, 40], [7, 8, 60, 1], [33, 34, 35, 36]]
    with TieredStore(StoreSettings(l1_bytes=1 << 26, l2_path=str(tmp_path)), IDENTITY) as a:
        buffer = writer.new_host_buffer()
        assert buffer.is_pinned()
        for i, ids in enumerate(sources):
            writer.gather(ids, buffer)  # the saver reuses one pinned buffer
            meta = BlockMeta(
                num_tokens=TOKENS * PER_BLOCK,
                dtype=writer.layout.dtype_name,
                shape=writer.layout.shape,
                parent=CHAIN[i - 1] if i else root_hash(),
            )
            assert a.save(CHAIN[i], meta, host_bytes(buffer))
        assert a.flush(30.0)

    reader = PagedKV({n: torch.zeros_like(t) for n, t in _caches(seed=2).items()}, PER_BLOCK)
    targets = [[0, 1, 2, 3], [10, 11, 12, 13], [63, 20, 21, 22]]
    with TieredStore(StoreSettings(l1_bytes=1 << 26, l2_path=str(tmp_path)), IDENTITY) as b:
        # as the connector's loader: L2 reads into its pinned staging buffers, each copied in
        # before the next read may reuse it (an L2 hit promoted to L1 is ordinary memory)
        staging = [host_bytes(reader.new_host_buffer()) for _ in range(2)] if pinned else []
        loaded: list[Tier] = []

        def copy_in(block: LoadedBlock) -> None:
            assert reader.layout.matches(block.meta)
            src = payload_view(block.payload, reader.layout)
            assert src.is_pinned() == pinned
            reader.scatter(src, targets[len(loaded)])
            loaded.append(block.tier)

        assert b.load_into(CHAIN, copy_in, staging=staging) == 3
        assert loaded == [Tier.L2] * 3  # a fresh replica: every block comes from L2
    torch.cuda.synchronize()
    for ids, src in zip(targets, sources, strict=True):
        for got, expected in zip(_blocks(reader, ids), _blocks(writer, src), strict=True):
            assert torch.equal(got, expected)
    untouched = [b for b in range(ENGINE_BLOCKS) if all(b not in ids for ids in targets)]
    assert not any(_blocks(reader, untouched)[layer].any() for layer in range(LAYERS))


def test_a_partial_scatter_keeps_the_locally_computed_leading_blocks() -> None:
    source = PagedKV(_caches(seed=3), PER_BLOCK)
    buffer = source.new_host_buffer()
    source.gather([4, 5, 6, 7], buffer)
    target = PagedKV({n: torch.zeros_like(t) for n, t in _caches(seed=3).items()}, PER_BLOCK)
    target.scatter(buffer, [20, 21], skip=1)  # engine blocks 1 and 2 of the payload only
    torch.cuda.synchronize()
    for got, expected in zip(_blocks(target, [20, 21]), _blocks(source, [5, 6]), strict=True):
        assert torch.equal(got, expected)
    assert not any(t[[0, 19, 22]].any() for t in target.layers)


@pytest.mark.parametrize("forward_stream", ["default", "vllms-own"])
def test_a_gather_from_another_thread_sees_what_the_forward_pass_queued_before_it(
    forward_stream: str,
) -> None:
    """The saver runs after the forward pass was queued, not finished: its side stream must
    wait for that work (here a long queue of matmuls, then the write). vLLM queues its forward
    pass on a stream of its own (`vllm.utils.torch_utils.current_stream`), which the default
    stream does not wait for: the worker hands the saver a `forward_mark` taken after it."""
    kv = PagedKV({n: torch.zeros_like(t) for n, t in _caches(seed=4).items()}, PER_BLOCK)
    ids = [3, 4, 5, 6]
    index = torch.tensor(ids, device="cuda")  # made now: a copy later would wait for the queue
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if forward_stream == "vllms-own" else None
    with torch.cuda.stream(stream):
        for _ in range(50):  # ~tens of ms of queued work ahead of the write
            busy = busy @ busy
            busy = busy / busy.norm()
        for layer, t in enumerate(kv.layers):
            t.index_fill_(0, index, float(layer + 1))  # the "forward pass" writes them, queued
        mark = kv.forward_mark()
    buffer = kv.new_host_buffer()
    saver = threading.Thread(target=kv.gather, args=(ids, buffer, mark))
    saver.start()
    saver.join(60)
    assert not saver.is_alive()
    for layer in range(LAYERS):
        assert bool((buffer[layer] == float(layer + 1)).all()), f"layer {layer} read early"
