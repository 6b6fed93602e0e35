"""Model-identity namespaces and seedless chained block hashes.

Every replica of one model must name a block of KV identically, whatever its process, restart or
machine: vLLM's own block hashes are seeded per process, so kvtier computes its own.

    h_0   = H(ROOT ‖ extra)                      extra: LoRA adapter, cache salt, multimodal hashes
    h_i+1 = H(h_i ‖ token ids of block i as u32 little-endian)

H is BLAKE2b with a 16-byte digest (stdlib, no seed). Only full blocks are hashed: a partial tail
block has no stable content and is never stored.

The namespace is the digest of a canonical JSON of the model identity (weights, KV dtype and
layout, block size, parallelism, engine, format version); blocks of different namespaces never
mix. `manifest()` is written beside the data so a person can tell what a directory holds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NewType

from kvtier.core.errors import ConfigError

BlockHash = NewType("BlockHash", bytes)
"""16-byte chained digest naming one full block of tokens."""

Namespace = NewType("Namespace", str)
"""Hex digest of a model identity; every stored key lives under one."""

HASH_BYTES = 16
FORMAT_VERSION = 1
_ROOT = b"kvtier/v1/root"


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Everything that makes KV of one model incompatible with another's."""

    model: str
    """Model name or path as served."""
    weights_digest: str = ""
    """Digest of the weights (or a revision id); empty when unknown."""
    kv_dtype: str = "bfloat16"
    """Element type of the stored KV."""
    kv_layout: str = "layers,kv,tokens,heads,dim"
    """Axis order of a stored block's payload."""
    block_tokens: int = 256
    """Tokens per kvtier block."""
    tp_size: int = 1
    """Tensor-parallel world size (1 when the layout is parallelism-agnostic)."""
    tp_rank: int = 0
    """Tensor-parallel rank whose heads the block holds."""
    engine: str = "vllm"
    """Engine family; engine versions with identical layouts share blocks."""
    format_version: int = FORMAT_VERSION
    """kvtier block format version."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model: must not be empty")
        if self.block_tokens <= 0:
            raise ConfigError(f"block_tokens: must be positive, got {self.block_tokens}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank: {self.tp_rank} is outside tp_size {self.tp_size}")

    def canonical_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def namespace(self) -> Namespace:
        digest = hashlib.blake2b(self.canonical_json().encode(), digest_size=8).hexdigest()
        return Namespace(digest)

    def manifest(self) -> dict[str, object]:
        """Human-readable description written as `manifest.json` beside the data."""
        return {"namespace": self.namespace(), "identity": asdict(self)}


def _u32le(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


@functools.lru_cache(maxsize=1024)
def root_hash(extra: bytes = b"") -> BlockHash:
    """Parent of a request's first block; `extra` keeps salted or LoRA chains disjoint."""
    return BlockHash(hashlib.blake2b(_ROOT + extra, digest_size=HASH_BYTES).digest())


def extra_key(
    *,
    lora: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence[str] = (),
) -> bytes:
    """Canonical bytes for the request attributes that must split the cache. A LoRA adapter is
    keyed by its name and, given, its path, as vLLM keys it: an adapter name pointed at other
    weights never reuses the KV computed with the old ones."""
    if lora is None and cache_salt is None and not mm_hashes:
        return b""
    adapter = lora if lora_path is None else [lora, lora_path]
    doc = {"lora": adapter, "salt": cache_salt, "mm": list(mm_hashes)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def chain_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    return _chain(parent, _u32le(token_ids))


def _chain(parent: BlockHash, packed_ids: bytes) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(packed_ids)
    return BlockHash(h.digest())


def block_hashes(
    token_ids: Sequence[int], block_tokens: int, extra: bytes = b"", parent: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (the partial tail is skipped).

    `parent` continues an existing chain (incremental hashing of a growing sequence); by default
    the chain starts at `root_hash(extra)`.
    """
    if block_tokens <= 0:
        raise ConfigError(f"block_tokens: must be positive, got {block_tokens}")
    h = root_hash(extra) if parent is None else parent
    full = len(token_ids) // block_tokens * block_tokens
    packed = _u32le(token_ids[:full])  # once: the router hashes on its request path
    step = 4 * block_tokens
    out: list[BlockHash] = []
    for start in range(0, len(packed), step):
        h = _chain(h, packed[start : start + step])
        out.append(h)
    return out
