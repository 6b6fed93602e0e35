"""The replicas' and routers' compute resources in the overlay.

Without `kubernetes.replicaResources` a replica asks for `replica_memory_gib` (request = limit);
with it, `check_memory` refuses a memory limit below what the replica is known to need (an OOM
kill once warm), and `resources_block` replaces the base's whole block with the file's. Pure
functions of the file: a limit too low is a `ConfigError`.
"""

from __future__ import annotations

import math
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import GIB, FleetSpec
from kvtier.tools.deploy.settings import Resources

__all__ = ["GPU", "check_memory", "replica_memory_gib", "resources_block"]

GPU = "nvidia.com/gpu"
SHM_GIB = 2
"""The replicas' memory-backed /dev/shm (deploy/k8s/base/replicas.yaml): its pages count against
the container's memory limit."""
ENGINE_MEMORY_GIB = {"gpu": 26, "cpu": 2}
"""A replica's host memory for vLLM itself (processes, CUDA, weights on CPU), by device."""
MIN_ENGINE_MEMORY_GIB = {"gpu": 8, "cpu": 1}
"""The least of it a `replicaResources` memory limit may leave."""
_QUANTITY_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_QUANTITY_UNITS |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def replica_memory_gib(spec: FleetSpec, engine_gib: float | None = None) -> int:
    """A replica's host memory in whole GiB: `engine_gib` for vLLM (`ENGINE_MEMORY_GIB` of the
    device by default), its L1, the memory-backed /dev/shm, and on CPU the engine's KV cache."""
    device = spec.kubernetes.device
    gib = ENGINE_MEMORY_GIB[device] if engine_gib is None else engine_gib
    gib += SHM_GIB + (spec.cache.l1_gib if spec.cache.l1_enabled else 0)
    if device == "cpu":
        gib += spec.local.engine_kv_cache_gib
    return math.ceil(gib)


def resources_block(
    resources: Resources, gpu: bool, requests: dict[str, str] | None = None
) -> dict[str, Any]:
    """`resources` in place of the base's whole block, with `requests` they do not give; with
    `gpu`, one GPU unless they give a count (Kubernetes takes it as a limit: `Resources` copies
    a request there)."""
    dumped = resources.model_dump()
    dumped["requests"] = {**(requests or {}), **dumped["requests"]}
    if gpu:
        dumped["limits"].setdefault(GPU, "1")
    return {"$patch": "replace", **dumped}


def check_memory(spec: FleetSpec, resources: Resources) -> None:
    """A `ConfigError` if `resources` limit the replicas' memory below their L1, /dev/shm (and
    on CPU the engine's KV cache) with the least memory vLLM runs in: an OOM kill once warm."""
    limit = resources.limits.get("memory")
    device = spec.kubernetes.device
    needed = replica_memory_gib(spec, MIN_ENGINE_MEMORY_GIB[device])
    if limit is None or _gib(limit) >= needed:
        return
    l1 = spec.cache.l1_gib if spec.cache.l1_enabled else 0
    engine_kv = f" + kvtier.engineKvCacheGiB ({spec.local.engine_kv_cache_gib})"
    raise ConfigError(
        f"kubernetes.replicaResources.limits.memory: {limit} is below kvCacheSpec.l1CacheSizeGiB "
        f"({l1:g}) + /dev/shm ({SHM_GIB}){engine_kv if device == 'cpu' else ''} + "
        f"{MIN_ENGINE_MEMORY_GIB[device]} for vLLM = {needed}Gi: raise the limit or lower the L1"
    )


def _gib(quantity: str) -> float:
    """A Kubernetes quantity ("30Gi", "32G", "500m") in GiB."""
    number = quantity.rstrip("mkMGTi")
    return float(number) * _QUANTITY_UNITS[quantity[len(number) :]] / GIB
