"""The versioned, checksummed block format shared by every L2 backend.

A stored block is a fixed 4 KiB header followed by the raw payload:

    offset  size  field
         0     8  magic b"KVTBLK\\r\\n" (the CR/LF pair catches text-mode mangling)
         8     2  format version (u16)
        10     2  reserved, zero
        12     4  header size (u32, 4096)
        16    32  namespace, ASCII, NUL-padded
        48    16  block hash
        64    16  parent hash
        80     4  tokens in the block (u32)
        84    16  dtype name, ASCII, NUL-padded ("bfloat16")
       100     1  number of shape dimensions (u8, at most 8)
       101     3  reserved, zero
       104    64  shape, 8 x u64 (unused dimensions zero)
       168     8  payload length in bytes (u64)
       176     8  xxh3-64 of the payload (u64)
       184     8  xxh3-64 of bytes 0..183 of the header (u64)
       192  3904  zero padding up to 4096

All integers are little-endian. The header is page-aligned so the payload can be read with
large sequential I/O straight into its final buffer. `decode_header` validates every field
against what the reader expects; `verify_payload` checks the payload checksum. Any mismatch
raises `CodecError` (or `ChecksumError`), which the tiers turn into a miss.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvtier.core.errors import ChecksumError, CodecError
from kvtier.core.keys import HASH_BYTES, BlockHash, Namespace

if TYPE_CHECKING:  # collections.abc.Buffer arrives in Python 3.12
    from typing_extensions import Buffer

MAGIC = b"KVTBLK\r\n"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
MAX_DIMS = 8

_FIELDS = struct.Struct("<8sHHI32s16s16sI16sB3x8QQQ")
_HEADER_CHECK = struct.Struct("<Q")
_CHECKED_BYTES = _FIELDS.size  # 184: the header checksum covers everything before it

# Element sizes of dtypes whose payload length can be cross-checked against the shape.
_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a reader needs to interpret a payload; stored in the block header."""

    num_tokens: int
    """Tokens in the block (always a full block)."""
    dtype: str
    """Element type name, e.g. "bfloat16" (numpy/torch spelling, at most 16 ASCII bytes)."""
    shape: tuple[int, ...]
    """Payload layout, e.g. (layers, 2, tokens, kv_heads, head_dim); at most 8 dimensions."""
    parent: BlockHash
    """Hash of the previous block in the chain (`keys.root_hash(...)` for the first block)."""

    def __post_init__(self) -> None:
        if not 0 < self.num_tokens < 2**32:
            raise CodecError(f"num_tokens: must be in 1..2^32-1, got {self.num_tokens}")
        if not self.dtype or len(self.dtype) > 16 or not self.dtype.isascii():
            raise CodecError(f"dtype: must be 1..16 ASCII characters, got {self.dtype!r}")
        if len(self.shape) > MAX_DIMS or any(d < 0 for d in self.shape):
            raise CodecError(f"shape: at most {MAX_DIMS} non-negative dims, got {self.shape}")
        if len(self.parent) != HASH_BYTES:
            raise CodecError(f"parent: must be {HASH_BYTES} bytes, got {len(self.parent)}")

    def expected_payload_bytes(self) -> int | None:
        """Payload length implied by dtype and shape; None for a dtype the codec does not know."""
        itemsize = _ITEMSIZE.get(self.dtype)
        return None if itemsize is None else itemsize * math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded, validated header."""

    namespace: Namespace
    block_hash: BlockHash
    meta: BlockMeta
    payload_bytes: int
    checksum: int


def byte_view(payload: Buffer) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (bytes, numpy array, memoryview)."""
    view = memoryview(payload)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("payload: must be a C-contiguous buffer")
    return view.cast("B")


def payload_checksum(payload: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def check_payload_length(meta: BlockMeta, payload_bytes: int) -> None:
    """Reject a payload whose length contradicts the dtype and shape in `meta`."""
    expected = meta.expected_payload_bytes()
    if expected is not None and expected != payload_bytes:
        raise CodecError(
            f"payload: {payload_bytes} bytes, but {meta.dtype}{list(meta.shape)} needs {expected}"
        )


def encode_header(
    namespace: Namespace, block_hash: BlockHash, meta: BlockMeta, payload: Buffer
) -> bytes:
    """Header bytes for `payload` (which is written right after it, unchanged)."""
    view = byte_view(payload)
    check_payload_length(meta, view.nbytes)
    if len(block_hash) != HASH_BYTES:
        raise CodecError(f"block_hash: must be {HASH_BYTES} bytes, got {len(block_hash)}")
    ns = namespace.encode("ascii")
    if len(ns) > 32:
        raise CodecError(f"namespace: at most 32 ASCII bytes, got {namespace!r}")
    shape = list(meta.shape) + [0] * (MAX_DIMS - len(meta.shape))
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        HEADER_BYTES,
        ns,
        block_hash,
        meta.parent,
        meta.num_tokens,
        meta.dtype.encode("ascii"),
        len(meta.shape),
        *shape,
        view.nbytes,
        payload_checksum(view),
    )
    head = fields + _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(fields))
    return head + bytes(HEADER_BYTES - len(head))


def decode_header(
    data: Buffer, *, namespace: Namespace, block_hash: BlockHash | None = None
) -> Header:
    """Parse and validate a header; `block_hash`, when given, must match the stored one."""
    view = memoryview(data)
    if view.nbytes < HEADER_BYTES:
        raise CodecError(f"header: {view.nbytes} bytes, need {HEADER_BYTES}")
    (magic, version, _, header_bytes, ns, stored_hash, parent, num_tokens, dtype, ndim, *rest) = (
        _FIELDS.unpack_from(view)
    )
    shape, payload_bytes, checksum = rest[:MAX_DIMS], rest[MAX_DIMS], rest[MAX_DIMS + 1]
    if magic != MAGIC:
        raise CodecError(f"magic: {magic!r} is not a kvtier block")
    if version != FORMAT_VERSION:
        raise CodecError(f"version: block format {version}, reader speaks {FORMAT_VERSION}")
    (head_check,) = _HEADER_CHECK.unpack_from(view, _CHECKED_BYTES)
    if head_check != xxhash.xxh3_64_intdigest(view[:_CHECKED_BYTES]):
        raise ChecksumError("header: checksum mismatch")
    if header_bytes != HEADER_BYTES:
        raise CodecError(f"header: size {header_bytes}, expected {HEADER_BYTES}")
    stored_ns = _ascii_field(ns, "namespace")
    if stored_ns != namespace:
        raise CodecError(f"namespace: block is from {stored_ns!r}, reader is {namespace!r}")
    if block_hash is not None and stored_hash != block_hash:
        raise CodecError(f"block_hash: file holds {stored_hash.hex()}, expected {block_hash.hex()}")
    if ndim > MAX_DIMS or any(shape[ndim:]):
        raise CodecError(f"shape: {ndim} dims with trailing {shape[ndim:]}")
    meta = BlockMeta(
        num_tokens=num_tokens,
        dtype=_ascii_field(dtype, "dtype"),
        shape=tuple(shape[:ndim]),
        parent=BlockHash(parent),
    )
    check_payload_length(meta, payload_bytes)
    return Header(
        namespace=Namespace(stored_ns),
        block_hash=BlockHash(stored_hash),
        meta=meta,
        payload_bytes=payload_bytes,
        checksum=checksum,
    )


def _ascii_field(raw: bytes, name: str) -> str:
    """A NUL-padded ASCII header field as text; CodecError if it is not ASCII."""
    try:
        return raw.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise CodecError(f"{name}: {raw!r} is not ASCII") from None


def verify_payload(header: Header, payload: Buffer, *, checksum: int | None = None) -> None:
    """Raise unless `payload` has the header's length and checksum; `checksum` is the payload's
    xxh3-64 when the caller already computed it while reading (then it is not hashed again)."""
    view = memoryview(payload)
    verify_read(header, view.nbytes, payload_checksum(view) if checksum is None else checksum)


def verify_read(header: Header, nbytes: int, checksum: int) -> None:
    """Raise unless `nbytes` bytes whose xxh3-64 is `checksum` are the header's payload."""
    if nbytes != header.payload_bytes:
        raise CodecError(f"payload: {nbytes} bytes, header says {header.payload_bytes}")
    if checksum != header.checksum:
        raise ChecksumError(f"payload: checksum mismatch in block {header.block_hash.hex()}")
