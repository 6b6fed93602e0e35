"""Helpers shared by the tier tests: small deterministic blocks and chains."""

from __future__ import annotations

import hashlib

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash, Namespace, root_hash

NAMESPACE = Namespace("00112233aabbccdd")
SHAPE = (2, 2, 4, 1, 8)  # layers, kv, tokens, heads, dim: 128 bf16 values = 256 bytes


def hash_of(name: str) -> BlockHash:
    return BlockHash(hashlib.blake2b(name.encode(), digest_size=16).digest())


def payload_for(block_hash: BlockHash, nbytes: int) -> bytes:
    """Deterministic bytes derived from the hash, so any process can check what it reads."""
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(block_hash + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:nbytes])


def meta_for(nbytes: int, parent: BlockHash | None = None) -> BlockMeta:
    """Meta of a uint8 payload of `nbytes` (any size; the codec checks shape x itemsize)."""
    return BlockMeta(
        num_tokens=4,
        dtype="uint8",
        shape=(nbytes,),
        parent=root_hash() if parent is None else parent,
    )


def variant_payload(block_hash: BlockHash, writer: int, nbytes: int) -> bytes:
    """Writer `writer`'s payload for `block_hash`: same key, different bytes per writer, so a
    reader can tell a whole block from a mix of two writers' blocks."""
    return payload_for(BlockHash(block_hash + bytes([writer])), nbytes)
