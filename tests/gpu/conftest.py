"""GPU tests run where torch sees CUDA. The GPU machines lent to this project have no vLLM
CUDA build (nothing can be installed there from outside), so where vLLM cannot be imported the
few vLLM names `kvtier.vllm.compat` imports are stood in for: empty base classes and enums,
which carry no behaviour these tests exercise. The worker side's code is kvtier's own; the
connector inside a real vLLM engine is proven on CPU (`tests/vllm/test_connector_engine.py`).
"""

from __future__ import annotations

import abc
import enum
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch


def _module(name: str, **names: object) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(names)
    sys.modules[name] = module


@dataclass
class _Stats:
    data: dict[str, Any] = field(default_factory=dict)


def _stand_in_for_vllm() -> None:
    parts = "vllm.distributed.kv_transfer.kv_connector.v1".split(".")
    for depth in range(1, len(parts) + 1):
        _module(".".join(parts[:depth]))
    for name in ("vllm.v1", "vllm.v1.metrics"):
        _module(name)
    _module(
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        KVConnectorBase_V1=type("KVConnectorBase_V1", (abc.ABC,), {}),
        KVConnectorMetadata=type("KVConnectorMetadata", (abc.ABC,), {}),
        KVConnectorWorkerMetadata=type("KVConnectorWorkerMetadata", (abc.ABC,), {}),
        KVConnectorRole=enum.Enum("KVConnectorRole", "SCHEDULER WORKER"),
    )
    _module(
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
        KVConnectorStats=_Stats,
        KVConnectorPromMetrics=type("KVConnectorPromMetrics", (), {}),
    )
    _module(
        "vllm.v1.metrics.cache_hit_source", CacheHitSource=enum.Enum("CacheHitSource", "HOST DISK")
    )


if torch.cuda.is_available():
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    except ImportError:
        _stand_in_for_vllm()
