"""The block decoder against mutated blocks: every mutation of a valid block is rejected with a
CodecError, or decodes to exactly the original meta and payload; nothing else escapes.

Mutations: bit flips, overwritten byte ranges, truncations, extensions, header fields replaced,
header fields replaced with the header checksum recomputed (a buggy writer that re-seals what
it wrote), and whole blocks re-encoded under another model's namespace or another block's hash
(valid checksums). A resealed header can change what the reader cannot check against its own
expectations (tokens, shape of a dtype the codec does not know): the checksum is integrity, not
authenticity, and the L2 is writable by the fleet only (docs/security.md). The payload handed
out is then still the original, byte for byte. A share of the mutated files is also read
through the POSIX tier, which must miss and remove them."""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.codec import (
    HEADER_BYTES,
    BlockMeta,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.core.errors import CodecError
from kvtier.core.keys import BlockHash, Namespace
from kvtier.core.tiers.posix import PosixTier
from tests.fuzz.budget import cases, fuzz_settings

NS = Namespace("0123456789abcdef")
OTHER_NS = Namespace("fedcba9876543210")
MUTATIONS_PER_BLOCK = 10
BLOCKS = cases(300, 10_000)
"""Valid blocks generated; each is mutated MUTATIONS_PER_BLOCK times."""
COUNTS = {"inputs": 0, "accepted": 0, "through_tier": 0}

blocks = st.builds(
    lambda h, parent, dtype, dims, tokens, seed: _block(h, parent, dtype, dims, tokens, seed),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=16, max_size=16),
    st.sampled_from(["uint8", "float16", "bfloat16", "float32", "int8", "weird-dtype"]),
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.integers(1, 2**32 - 1),
    st.integers(0, 2**32),
)
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(0, 7)),
    st.tuples(st.just("overwrite"), st.integers(0, 2**20), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(
        st.sampled_from(["field", "resealed"]),
        st.sampled_from(["magic", "version", "header_bytes", "payload_bytes"]),
        st.integers(0, 2**64 - 1),
    ),
    st.tuples(
        st.sampled_from(["field", "resealed-meta"]),
        st.sampled_from(["num_tokens", "ndim", "shape0"]),
        st.integers(0, 2**64 - 1),
    ),
    st.tuples(st.just("namespace"), st.just(OTHER_NS)),
    st.tuples(st.just("hash"), st.binary(min_size=16, max_size=16)),
)

# field -> (offset, struct format) in the header (kvtier.core.codec's layout)
FIELDS = {
    "magic": (0, "<Q"),
    "version": (8, "<H"),
    "header_bytes": (12, "<I"),
    "num_tokens": (80, "<I"),
    "ndim": (100, "<B"),
    "shape0": (104, "<Q"),
    "payload_bytes": (168, "<Q"),
}


def _block(
    h: bytes, parent: bytes, dtype: str, dims: list[int], tokens: int, seed: int
) -> tuple[BlockHash, BlockMeta, bytes]:
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}.get(dtype, 1)
    size = itemsize
    for d in dims:
        size *= d
    payload = xxhash.xxh3_128_digest(seed.to_bytes(8, "little")) * (size // 16 + 1)
    meta = BlockMeta(num_tokens=tokens, dtype=dtype, shape=tuple(dims), parent=BlockHash(parent))
    return BlockHash(h), meta, payload[:size]


def _mutate(data: bytes, block: tuple[BlockHash, BlockMeta, bytes], m: tuple) -> bytes:
    kind = m[0]
    buf = bytearray(data)
    if kind == "flip":
        pos = m[1] % len(buf)
        buf[pos] ^= 1 << m[2]
    elif kind == "overwrite":
        pos = m[1] % len(buf)
        buf[pos : pos + len(m[2])] = m[2]
    elif kind == "truncate":
        del buf[m[1] % len(buf) :]
    elif kind == "extend":
        buf += m[1]
    elif kind in ("field", "resealed", "resealed-meta"):
        offset, fmt = FIELDS[m[1]]
        value = m[2] % (1 << (8 * struct.calcsize(fmt)))
        struct.pack_into(fmt, buf, offset, value)
        if kind != "field":  # a writer that re-seals the header it changed
            struct.pack_into("<Q", buf, 184, xxhash.xxh3_64_intdigest(bytes(buf[:184])))
    elif kind == "namespace":
        h, meta, payload = block
        return encode_header(m[1], h, meta, payload) + payload
    elif kind == "hash":
        _, meta, payload = block
        return encode_header(NS, BlockHash(m[1]), meta, payload) + payload
    return bytes(buf)


def _accepts(data: bytes, h: BlockHash) -> tuple[BlockMeta, bytes] | None:
    """What a reader takes from `data`: (meta, payload), or None when it rejects it."""
    try:
        header = decode_header(data[:HEADER_BYTES], namespace=NS, block_hash=h)
        payload = data[HEADER_BYTES:]
        verify_payload(header, payload)
    except CodecError:
        return None
    return header.meta, payload


@fuzz_settings(BLOCKS)
@given(blocks, st.lists(mutation, min_size=MUTATIONS_PER_BLOCK, max_size=MUTATIONS_PER_BLOCK))
def test_a_mutated_block_is_rejected_or_decodes_to_the_original(block, mutations) -> None:
    h, meta, payload = block
    original = encode_header(NS, h, meta, payload) + payload
    assert _accepts(original, h) == (meta, payload)
    for m in mutations:
        data = _mutate(original, block, m)
        COUNTS["inputs"] += 1
        taken = _accepts(data, h)
        if taken is not None:
            COUNTS["accepted"] += 1
            if m[0] == "resealed-meta":
                assert taken[1] == payload, m  # the reader's own checks hold; bytes intact
            else:
                assert taken == (meta, payload), (m, taken)


def test_the_fuzz_ran_its_full_count() -> None:
    """Runs after the fuzz test (file order): the promised number of inputs was decoded."""
    assert COUNTS["inputs"] >= BLOCKS * MUTATIONS_PER_BLOCK


@fuzz_settings(cases(60, 1000))
@given(blocks, mutation)
def test_mutated_files_read_through_the_posix_tier_miss_and_are_removed(
    tmp_path_factory, block, m
) -> None:
    root = tmp_path_factory.mktemp("l2", numbered=True)
    h, meta, payload = block
    tier = PosixTier(str(root), NS, {"fuzz": True}, exists_ttl_s=0)
    original = encode_header(NS, h, meta, payload) + payload
    data = _mutate(original, block, m)
    path = Path(tier.path(h))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    got = tier.get(h)
    COUNTS["through_tier"] += 1
    taken = _accepts(data, h)
    if taken is None:
        assert got is None and not path.exists()
        assert tier.stats().corrupt_removed == 1
    else:
        assert got is not None and bytes(got.payload) == payload and got.meta == taken[0]
