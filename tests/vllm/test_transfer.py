"""Gather/scatter between paged per-layer KV tensors and one contiguous payload (CPU)."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.errors import ConfigError
from kvtier.vllm.transfer import PagedKV, host_bytes, payload_view

LAYERS, BLOCKS, HEADS, TOKENS, DIM2 = 3, 8, 2, 4, 6


def _caches() -> dict[str, torch.Tensor]:
    # Named out of order: layer 10 must come after layer 2.
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.0.attn"]
    return {n: torch.randn(BLOCKS, HEADS, TOKENS, DIM2).to(torch.bfloat16) for n in names}


def test_layout_describes_per_block_engine_blocks_of_every_layer() -> None:
    kv = PagedKV(_caches(), per_block=2)
    assert kv.layout.shape == (LAYERS, 2, HEADS, TOKENS, DIM2)
    assert kv.layout.dtype_name == "bfloat16"
    assert kv.layout.payload_bytes == LAYERS * 2 * HEADS * TOKENS * DIM2 * 2


def test_gather_copies_blocks_layer_by_layer_in_natural_layer_order() -> None:
    caches = _caches()
    kv = PagedKV(caches, per_block=2)
    out = kv.new_host_buffer()
    kv.gather([5, 1], out)
    for i, name in enumerate(
        ["model.layers.0.attn", "model.layers.2.attn", "model.layers.10.attn"]
    ):
        assert torch.equal(out[i, 0], caches[name][5])
        assert torch.equal(out[i, 1], caches[name][1])


def test_payload_roundtrip_restores_blocks_exactly_and_touches_nothing_else() -> None:
    source = PagedKV(_caches(), per_block=2)
    buffer = source.new_host_buffer()
    source.gather([3, 4], buffer)
    payload = memoryview(bytes(host_bytes(buffer)))  # what the store hands back: read-only

    target_caches = {n: torch.zeros_like(t) for n, t in _caches().items()}
    target = PagedKV(target_caches, per_block=2)
    target.scatter(payload_view(payload, target.layout), [6, 0])

    for layer, t in enumerate(target.layers):
        assert torch.equal(t[6], source.layers[layer][3])
        assert torch.equal(t[0], source.layers[layer][4])
        untouched = [b for b in range(BLOCKS) if b not in (6, 0)]
        assert not t[untouched].any()


def test_scatter_with_skip_keeps_locally_computed_leading_blocks() -> None:
    source = PagedKV(_caches(), per_block=2)
    buffer = source.new_host_buffer()
    source.gather([3, 4], buffer)
    target = PagedKV({n: torch.zeros_like(t) for n, t in _caches().items()}, per_block=2)
    target.scatter(buffer, [7], skip=1)  # block 0 of the pair is already local
    for layer, t in enumerate(target.layers):
        assert torch.equal(t[7], source.layers[layer][4])
        assert not t[:7].any()


def test_scatter_of_fewer_ids_writes_only_the_leading_engine_blocks() -> None:
    source = PagedKV(_caches(), per_block=2)
    buffer = source.new_host_buffer()
    source.gather([3, 4], buffer)
    target = PagedKV({n: torch.zeros_like(t) for n, t in _caches().items()}, per_block=2)
    target.scatter(buffer, [5])  # a hit vLLM trimmed to the block's first half
    for layer, t in enumerate(target.layers):
        assert torch.equal(t[5], source.layers[layer][3])
        assert not t[:5].any() and not t[6:].any()
    with pytest.raises(ValueError, match="at most 1"):
        target.scatter(buffer, [5, 6], skip=1)


def test_block_ids_are_checked() -> None:
    kv = PagedKV(_caches(), per_block=2)
    out = kv.new_host_buffer()
    with pytest.raises(ValueError, match="outside"):
        kv.gather([1, BLOCKS], out)
    with pytest.raises(ValueError, match="expected 2"):
        kv.gather([1], out)


def test_payload_of_the_wrong_size_is_refused() -> None:
    kv = PagedKV(_caches(), per_block=2)
    with pytest.raises(ValueError, match="bytes"):
        payload_view(memoryview(bytes(10)), kv.layout)


def test_layers_of_different_shapes_are_refused() -> None:
    caches = _caches()
    caches["model.layers.0.attn"] = torch.zeros(BLOCKS, HEADS, TOKENS, DIM2 + 2)
    with pytest.raises(ConfigError, match="layer"):
        PagedKV(caches, per_block=2)


def test_strided_engine_layers_round_trip() -> None:
    """Engine tensors need not be contiguous (a backend may lay blocks out inside a larger
    allocation): only the last dimension must be dense."""
    names = ["model.layers.0.attn", "model.layers.1.attn"]

    def strided() -> dict[str, torch.Tensor]:
        return {
            n: torch.randn(HEADS, BLOCKS, TOKENS, DIM2).to(torch.bfloat16).transpose(0, 1)
            for n in names
        }

    source = PagedKV(strided(), per_block=2)
    assert not source.layers[0].is_contiguous()
    buffer = source.new_host_buffer()
    source.gather([7, 2], buffer)
    target = PagedKV({n: torch.zeros_like(t) for n, t in strided().items()}, per_block=2)
    target.scatter(payload_view(host_bytes(buffer), target.layout), [1, 3])
    for layer, t in enumerate(target.layers):
        assert torch.equal(t[1], source.layers[layer][7])
        assert torch.equal(t[3], source.layers[layer][2])
        assert not t[[b for b in range(BLOCKS) if b not in (1, 3)]].any()
