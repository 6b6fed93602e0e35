"""kvtier: a tiered KV cache and a KV-aware router for fleets of vLLM replicas.

The names here are the core's library API: a replica's tiered store and what it stores.

    from kvtier import BlockMeta, ModelIdentity, StoreSettings, TieredStore, block_hashes

    identity = ModelIdentity(model="my-model", block_tokens=128)
    with TieredStore(StoreSettings(l1_bytes="1GiB", l2_path="/mnt/kv"), identity) as store:
        hashes = block_hashes(token_ids, 128)
        store.save(hashes[0], BlockMeta(num_tokens=128, dtype="bfloat16", shape=(n,),
                                         parent=root_hash()), payload)
        store.lookup(hashes)          # tiers of the longest cached prefix
        store.load(hashes)            # the blocks, L2 hits promoted into L1

The vLLM connector is `kvtier.vllm.connector.KvtierConnector`, the router `kvtier.router.app`.
"""

from importlib.metadata import PackageNotFoundError, version

from kvtier.core.codec import BlockMeta
from kvtier.core.errors import (
    CodecError,
    ConfigError,
    KvtierError,
    ModelError,
    RoutingError,
    TierError,
)
from kvtier.core.keys import BlockHash, ModelIdentity, Namespace, block_hashes, root_hash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import LoadedBlock, StoreStats, TieredStore
from kvtier.core.tiers.base import Tier

__all__ = [
    "BlockHash",
    "BlockMeta",
    "CodecError",
    "ConfigError",
    "KvtierError",
    "LoadedBlock",
    "ModelError",
    "ModelIdentity",
    "Namespace",
    "RoutingError",
    "StoreSettings",
    "StoreStats",
    "Tier",
    "TierError",
    "TieredStore",
    "block_hashes",
    "root_hash",
]

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
