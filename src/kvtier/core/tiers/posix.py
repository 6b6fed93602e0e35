"""L2 on a shared POSIX directory (a FUSE/NFS/Lustre mount, or a local directory).

Layout, derived only from the key so every replica (and a restarted one) finds every block:

    <root>/<namespace>/manifest.json              the model identity, for humans
    <root>/<namespace>/<h[0:2]>/<h[2:4]>/<h>.kvt   one block: `kvtier.core.codec` header + payload

Publishing is atomic and multi-writer safe: the block is written to a uniquely named temp file
(`<h>.kvt.<random>.tmp`, opened with O_EXCL, never a fixed name) in the final directory, then
hard-linked to its final name. EEXIST means another replica published the same block first:
that is success. Where hard links are unsupported the temp file is renamed into place instead
(the content is a pure function of the key, so replacing an identical file is harmless).
Readers therefore only ever see complete files; a file that still fails validation (bit rot,
a foreign writer, another format version) is a miss, is deleted and is counted.

A write is one `writev` of header and payload (the page
cache then holds the file in large folios, which makes later reads faster than chunked writes
would). A read goes into a small header buffer and the payload's own uninitialised buffer in
256 KiB pieces, each hashed right after it is read, while still in the CPU cache, so verifying
the checksum costs no second pass over memory. The payload is returned read-only (no copy) and
adopted as is by L1.

Existence answers (`contains`) are cached for `exists_ttl_s`: a batched lookup over a FUSE
mount then costs one stat per block per TTL, and a fresh miss re-checks after the TTL.

Faults (EIO, ENOSPC, a vanished mount) never raise: they are counted as errors, logged once
per kind, and turned into misses or failed puts. Construction raises `TierError` when the root
is missing or unwritable, so the store can fall back to L1-only with a clear warning.

A read hit is reported to the optional `AccessRecorder`, which refreshes the block's mtime (the
cluster-wide recency the capacity janitor evicts by; atime is not kept on FUSE).

Thread-safe; called by the store's I/O threads (puts) and by the engine's threads (gets).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvtier.core.codec import (
    HEADER_BYTES,
    BlockMeta,
    byte_view,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.core.errors import CodecError, TierError
from kvtier.core.keys import BlockHash, Namespace
from kvtier.core.lru import Lru
from kvtier.core.tiers.base import PutResult, StoredBlock, Tier, TierCounters, TierStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvtier.core.tiers.janitor import AccessRecorder

log = logging.getLogger(__name__)

SUFFIX = ".kvt"
MANIFEST = "manifest.json"
_EXISTS_CACHE_MAX = 1 << 16
READ_CHUNK_BYTES = 256 * 1024
"""Payload read and hash granularity: large sequential reads that still fit the CPU's L2 cache."""
MAX_PAYLOAD_BYTES = 1 << 30
"""Files larger than this are not blocks (a 256-token block of a 70B model is ~80 MiB)."""
# link() errors meaning "this filesystem cannot hard-link", not "the write failed".
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def _write_all(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _read_into(fd: int, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> int:
    """Fill `view` from `fd` in `READ_CHUNK_BYTES` pieces, hashing each piece right after it is
    read, while it is still in the CPU cache (a separate pass would read the whole payload from
    memory a second time). Returns the bytes read; short only at EOF."""
    done = 0
    while done < view.nbytes:
        n = os.readv(fd, [view[done : done + READ_CHUNK_BYTES]])
        if n == 0:
            break
        if hasher is not None:
            hasher.update(view[done : done + n])
        done += n
    return done


def publish(path: str, views: list[memoryview]) -> bool:
    """Atomically create `path` with the concatenation of `views`.

    Returns True if this call created it, False if it already existed (another writer won).
    Raises OSError on a real I/O failure.
    """
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, list(views))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
        if os.path.exists(path):
            return False
        os.replace(tmp, path)
        return True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


class PosixTier:
    """Shared-directory L2 tier for one namespace (see the module docstring)."""

    def __init__(
        self,
        root: str,
        namespace: Namespace,
        manifest: Mapping[str, object],
        *,
        exists_ttl_s: float = 1.0,
        access: AccessRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`access` records read hits in the shared access record the capacity janitor evicts
        by (`kvtier.core.tiers.janitor`); None records nothing."""
        if not os.path.isdir(root):
            raise TierError(
                f"L2 directory {root!r} does not exist (or is not a directory); "
                "it is not created automatically, so a missing mount is not "
                "silently replaced by a local directory"
            )
        self._namespace = namespace
        self._dir = os.path.join(root, namespace)
        self._ttl = exists_ttl_s
        self._access = access
        self._clock = clock
        self._lock = threading.Lock()
        self._exists: Lru[BlockHash, tuple[bool, float]] = Lru(_EXISTS_CACHE_MAX)
        self._made_dirs: set[str] = set()
        self._logged: set[str] = set()
        self._counters = TierCounters()
        try:
            os.makedirs(self._dir, exist_ok=True)
            body = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
            manifest_path = os.path.join(self._dir, MANIFEST)
            if not os.path.exists(manifest_path):
                publish(manifest_path, [memoryview(body)])
            probe = os.path.join(self._dir, f".probe.{uuid.uuid4().hex}.tmp")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(probe)
        except OSError as exc:
            raise TierError(f"L2 directory {self._dir!r} is not writable: {exc}") from exc

    @property
    def tier(self) -> Tier:
        return Tier.L2

    @property
    def directory(self) -> str:
        """`<root>/<namespace>`."""
        return self._dir

    def path(self, block_hash: BlockHash) -> str:
        h = block_hash.hex()
        return os.path.join(self._dir, h[0:2], h[2:4], h + SUFFIX)

    # ---- existence ----------------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        now = self._clock()
        cached = self._exists.peek(block_hash)
        if cached is not None and now - cached[1] < self._ttl:
            return cached[0]
        present = os.path.exists(self.path(block_hash))
        self._remember(block_hash, present, now)
        return present

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return [self.contains(h) for h in hashes]

    def _remember(self, block_hash: BlockHash, present: bool, now: float | None = None) -> None:
        if self._ttl <= 0:
            return
        with self._lock:
            self._exists.put(block_hash, (present, self._clock() if now is None else now))

    # ---- write --------------------------------------------------------------------------

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: Buffer) -> PutResult:
        path = self.path(block_hash)
        try:
            if os.path.exists(path):
                self._counters.add(already_present=1)
                self._remember(block_hash, True)
                return PutResult(stored=False)
            view = byte_view(payload)
            header = encode_header(self._namespace, block_hash, meta, view)
            self._ensure_dir(os.path.dirname(path))
            created = publish(path, [memoryview(header), view])
        except OSError as exc:
            self._fault("write", exc)
            return PutResult(stored=False)
        self._remember(block_hash, True)
        if created:
            self._counters.add(stored=1, bytes_written=view.nbytes)
        else:
            self._counters.add(already_present=1)
        return PutResult(stored=created)

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            with self._lock:
                self._made_dirs.add(directory)

    # ---- read ---------------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> StoredBlock | None:
        path = self.path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._remember(block_hash, False)
            self._counters.add(misses=1)
            return None
        except OSError as exc:
            self._fault("open", exc)
            self._counters.add(misses=1)
            return None
        try:
            opened = os.fstat(fd)
            size = opened.st_size
            if not HEADER_BYTES <= size <= HEADER_BYTES + MAX_PAYLOAD_BYTES:
                raise CodecError(f"file: {size} bytes is not a plausible block")
            head = memoryview(bytearray(HEADER_BYTES))
            got = _read_into(fd, head)
            header = decode_header(head[:got], namespace=self._namespace, block_hash=block_hash)
            if size != HEADER_BYTES + header.payload_bytes:
                raise CodecError(
                    f"file: {size} bytes, header says {HEADER_BYTES} + {header.payload_bytes}"
                )
            # The payload gets its own buffer, so L1 holds exactly the payload after promotion;
            # uninitialised, since the read overwrites every byte (bytearray would zero it).
            payload = np.empty(header.payload_bytes, dtype=np.uint8).data
            hasher = xxhash.xxh3_64()
            got = _read_into(fd, payload, hasher)
            verify_payload(header, payload[:got], checksum=hasher.intdigest())
            if self._access is not None:  # on the open fd: the very inode that was read
                self._access.record(fd, opened.st_mtime)
        except CodecError as exc:
            self._discard(path, opened, exc)
            self._remember(block_hash, False)
            self._counters.add(misses=1, corrupt_removed=1)
            return None
        except OSError as exc:
            self._fault("read", exc)
            self._counters.add(misses=1)
            return None
        finally:
            os.close(fd)
        self._remember(block_hash, True)
        self._counters.add(hits=1, bytes_read=payload.nbytes)
        return StoredBlock(header.meta, payload.toreadonly())

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        return [self.get(h) for h in hashes]

    def _discard(self, path: str, opened: os.stat_result, why: CodecError) -> None:
        """Delete a bad file, unless it was meanwhile replaced by another (good) one."""
        log.warning("kvtier L2: removing invalid block %s: %s", path, why)
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (opened.st_ino, opened.st_dev):
                os.unlink(path)
        except OSError:
            pass  # already gone: someone else removed it

    # ---- maintenance --------------------------------------------------------------------

    def remove(self, block_hash: BlockHash) -> bool:
        try:
            os.unlink(self.path(block_hash))
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._fault("remove", exc)
            return False
        finally:
            self._remember(block_hash, False)
        return True

    def _fault(self, op: str, exc: OSError) -> None:
        self._counters.add(errors=1)
        kind = f"{op}:{exc.errno}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(
                "kvtier L2 %s failed under %s (%s); treating it as a miss, further "
                "errors of this kind are only counted",
                op,
                self._dir,
                exc,
            )

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own file descriptors."""
