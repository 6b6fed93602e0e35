"""The block format: layout, round trip, and rejection of every kind of mismatch."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvtier.core.codec import (
    HEADER_BYTES,
    MAGIC,
    BlockMeta,
    byte_view,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.core.errors import ChecksumError, CodecError
from kvtier.core.keys import BlockHash, Namespace, root_hash
from tests.helpers.tiers import hash_of

NS = Namespace("0123456789abcdef")
H = hash_of("block")
SHAPE = (30, 2, 4, 3, 64)  # the embedded model's layout, 4 tokens
META = BlockMeta(num_tokens=4, dtype="bfloat16", shape=SHAPE, parent=root_hash())
PAYLOAD = (
    np.random.default_rng(7).integers(0, 256, 30 * 2 * 4 * 3 * 64 * 2, dtype=np.uint8).tobytes()
)


def reseal(header: bytearray) -> bytes:
    struct.pack_into("<Q", header, 184, xxhash.xxh3_64_intdigest(bytes(header[:184])))
    return bytes(header)


def test_header_is_one_aligned_page_starting_with_magic() -> None:
    header = encode_header(NS, H, META, PAYLOAD)
    assert len(header) == HEADER_BYTES == 4096
    assert header.startswith(MAGIC)
    assert header[192:] == bytes(HEADER_BYTES - 192)


def test_round_trip_restores_every_field() -> None:
    header = decode_header(encode_header(NS, H, META, PAYLOAD), namespace=NS, block_hash=H)
    assert header.namespace == NS
    assert header.block_hash == H
    assert header.meta == META
    assert header.payload_bytes == len(PAYLOAD)
    verify_payload(header, PAYLOAD)


def test_numpy_payload_of_any_shape_encodes_like_its_bytes() -> None:
    array = np.frombuffer(PAYLOAD, dtype=np.uint16).reshape(SHAPE)
    # numpy's stubs do not declare the buffer protocol: hence the ignores
    assert encode_header(NS, H, META, array) == encode_header(NS, H, META, PAYLOAD)  # type: ignore[arg-type]
    assert byte_view(array).nbytes == len(PAYLOAD)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="C-contiguous"):
        byte_view(array[:, :, ::2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "message"),
    [
        (0, "<8s", b"NOTKVT\r\n", "magic"),
        (8, "<H", 2, "version"),
        (12, "<I", 8192, "header"),
        (16, "<32s", b"fedcba9876543210", "namespace"),
        (16, "<32s", b"\xff" + NS.encode(), "namespace"),
        (48, "<16s", b"\x01" * 16, "block_hash"),
        (84, "<16s", b"\xffbfloat16", "dtype"),
        (100, "<B", 9, "shape"),
        (168, "<Q", len(PAYLOAD) + 2, "payload"),
    ],
)
def test_each_mismatching_field_is_rejected(
    offset: int, fmt: str, value: object, message: str
) -> None:
    header = bytearray(encode_header(NS, H, META, PAYLOAD))
    struct.pack_into(fmt, header, offset, value)
    with pytest.raises(CodecError, match=message):
        decode_header(reseal(header), namespace=NS, block_hash=H)


def test_any_flipped_header_bit_fails_the_header_checksum() -> None:
    original = encode_header(NS, H, META, PAYLOAD)
    for byte in range(8 + 2, 184):  # past magic and version, which are checked first
        header = bytearray(original)
        header[byte] ^= 0x40
        with pytest.raises(ChecksumError, match="header"):
            decode_header(bytes(header), namespace=NS, block_hash=H)


def test_flipped_payload_bit_fails_the_checksum() -> None:
    header = decode_header(encode_header(NS, H, META, PAYLOAD), namespace=NS)
    damaged = bytearray(PAYLOAD)
    damaged[len(damaged) // 2] ^= 0x01
    with pytest.raises(ChecksumError, match="payload"):
        verify_payload(header, damaged)


def test_short_payload_and_short_header_are_rejected() -> None:
    encoded = encode_header(NS, H, META, PAYLOAD)
    header = decode_header(encoded, namespace=NS)
    with pytest.raises(CodecError, match="payload"):
        verify_payload(header, PAYLOAD[:-1])
    with pytest.raises(CodecError, match="header"):
        decode_header(encoded[:100], namespace=NS)


def test_payload_length_must_match_dtype_and_shape() -> None:
    with pytest.raises(CodecError, match="needs"):
        encode_header(NS, H, META, PAYLOAD[:-2])
    odd = BlockMeta(num_tokens=4, dtype="my_fp6", shape=(3,), parent=root_hash())
    assert decode_header(encode_header(NS, H, odd, b"12345"), namespace=NS).meta == odd


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("num_tokens", {"num_tokens": 0}),
        ("dtype", {"dtype": ""}),
        ("dtype", {"dtype": "x" * 17}),
        ("shape", {"shape": (1,) * 9}),
        ("shape", {"shape": (-1,)}),
        ("parent", {"parent": BlockHash(b"short")}),
    ],
)
def test_block_meta_rejects_invalid_fields(field: str, kwargs: dict[str, object]) -> None:
    values: dict[str, object] = {
        "num_tokens": 4,
        "dtype": "bfloat16",
        "shape": SHAPE,
        "parent": root_hash(),
    } | kwargs
    with pytest.raises(CodecError, match=field):
        BlockMeta(**values)  # type: ignore[arg-type]
