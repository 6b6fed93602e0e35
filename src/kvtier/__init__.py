"""kvtier: a tiered KV cache and a KV-aware router for fleets of vLLM replicas."""

from kvtier.core.errors import (
    CodecError,
    ConfigError,
    KvtierError,
    ModelError,
    TierError,
)
from kvtier.core.keys import BlockHash, ModelIdentity, Namespace, block_hashes

__all__ = [
    "BlockHash",
    "CodecError",
    "ConfigError",
    "KvtierError",
    "ModelError",
    "ModelIdentity",
    "Namespace",
    "TierError",
    "block_hashes",
]
__version__ = "0.1.0"
