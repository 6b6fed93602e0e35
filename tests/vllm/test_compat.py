"""`kvtier.vllm.compat.check_kv_cache_layout` on vLLM's own KV cache config objects: the
layouts kvtier stores pass, the others are refused at start with an error naming why. (The
engine tests run the connector on the config vLLM builds for the embedded model.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvtier.core.errors import ConfigError
from kvtier.vllm.compat import check_kv_cache_layout, check_pipeline

FULL = FullAttentionSpec(block_size=128, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
SLIDING = SlidingWindowSpec(
    block_size=128, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=4096
)
MLA = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_one_group_of_full_attention_is_stored() -> None:
    check_kv_cache_layout(config(FULL))
    check_kv_cache_layout(None)  # (a vLLM that passes no config: the worker checks the tensors)


def test_the_hybrid_managers_groups_are_refused_naming_the_flag() -> None:
    """vLLM keeps them apart only when the flag forces its hybrid manager on for a connector;
    each group has its own block ids, and kvtier would save the others' layers at the first's."""
    with pytest.raises(ConfigError, match="--no-disable-hybrid-kv-cache-manager"):
        check_kv_cache_layout(config(FULL, SLIDING))


@pytest.mark.parametrize("spec", [MLA, SLIDING], ids=["mla", "sliding-window"])
def test_a_layout_other_than_k_and_v_heads_is_refused_naming_it(spec: KVCacheSpec) -> None:
    with pytest.raises(ConfigError, match=type(spec).__name__):
        check_kv_cache_layout(config(spec))


def test_a_state_space_model_is_refused() -> None:
    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    with pytest.raises(ConfigError, match="MambaSpec"):
        check_kv_cache_layout(config(mamba))


def test_pipeline_parallelism_is_refused_and_tensor_parallelism_is_not() -> None:
    """Stages of equal size would name their different layers' blocks alike (per TP rank)."""

    def config(stages: int, ranks: int) -> Any:
        parallel = SimpleNamespace(pipeline_parallel_size=stages, tensor_parallel_size=ranks)
        return SimpleNamespace(parallel_config=parallel)

    check_pipeline(config(1, 4))
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        check_pipeline(config(2, 1))
