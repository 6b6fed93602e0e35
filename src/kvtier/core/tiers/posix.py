"""L2 on a shared POSIX directory (a FUSE/NFS/Lustre mount, or a local directory).

Layout, derived only from the key so every replica (and a restarted one) finds every block:

    <root>/<namespace>/manifest.json              the model identity, for humans
    <root>/<namespace>/<h[0:2]>/<h[2:4]>/<h>.kvt   one block: `kvtier.core.codec` header + payload

Publishing is atomic and multi-writer safe: the block is written to a uniquely named temp file
(`<h>.kvt.<random>.tmp`, opened with O_EXCL, never a fixed name) in the final directory, then
renamed to its final name only if that name is free (`renameat2` with RENAME_NOREPLACE, one
metadata operation), or, where the file system refuses that, hard-linked to it and unlinked.
EEXIST means another replica published the same block first: that is success. Where hard links
are unsupported too, the temp file is renamed into place (the content is a pure function of
the key, so replacing an identical file is harmless).
Readers therefore only ever see complete files; a file that still fails validation (bit rot,
a foreign writer, another format version) is a miss, is deleted and is counted.

A write is one `writev` of header and payload (the page
cache then holds the file in large folios, which makes later reads faster than chunked writes
would). A read goes into a small header buffer and the payload's own uninitialised buffer in
1 MiB pieces, each hashed right after it is read, while still in the CPU cache, so verifying
the checksum costs no second pass over memory. `get` returns the payload read-only (no copy),
adopted as is by L1; `read_into` fills a staging buffer the caller reuses instead (the
connector's load path: fresh memory costs page faults that can exceed the read itself).

Existence answers (`contains`) are cached for `exists_ttl_s`: a batched lookup over a FUSE
mount then costs one stat per block per TTL, and a fresh miss re-checks after the TTL.

Faults (EIO, ENOSPC, a vanished mount) never raise: they are counted as errors, logged once
per kind, and turned into misses or failed puts. Directories removed under the tier (an
operator wiping `<root>/<namespace>`) are made again by the next put into them. Construction
raises `TierError` when the root is missing or unwritable, so the store can fall back to
L1-only with a clear warning.

A vanished mount is noticed (`_Volume`): the root holds a volume identity file
(`.kvtier/volume.json`, a random id written at first use), and the tier remembers that id and
the root's device and inode. At most every `VOLUME_CHECK_S`, and at once when a file it opens
lies on another device or it is about to create a directory, it checks the root is still that
device and inode, or else that the root holds the same identity (a remounted volume gets a new
device id). A FUSE mount detached under the replica
(`fusermount3 -u -z`, `umount -l`), a crashed FUSE daemon (ENOTCONN) or a replaced directory
turn L2 unusable: every call is a miss or a refused put, counted in `errors`, one warning says
so, and nothing is ever written to the bare directory (a block is also never published from a
temp file on another device); L2 resumes by itself once the volume is back.

Files are created 0600 and directories 0700 by default (`file_mode`); paths are built only from
the namespace and block hash as hex digits.

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
    Header,
    byte_view,
    decode_header,
    encode_header,
    verify_read,
)
from kvtier.core.errors import CodecError, TierError
from kvtier.core.keys import BlockHash, Namespace
from kvtier.core.lru import Lru
from kvtier.core.tiers.base import (
    PutResult,
    ReadTimes,
    StoredBlock,
    Tier,
    TierCounters,
    TierStats,
)
from kvtier.core.tiers.noreplace import UNSUPPORTED, rename_noreplace
from kvtier.core.tiers.usage import CONTROL_DIR, NAMESPACE, control_dir, real_dir

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvtier.core.tiers.janitor import AccessRecorder

log = logging.getLogger(__name__)

SUFFIX = ".kvt"
MANIFEST = "manifest.json"
_EXISTS_CACHE_MAX = 1 << 16
READ_CHUNK_BYTES = 1024 * 1024
"""Payload read and hash granularity of buffered reads: few system calls per block, and each
piece still in the CPU's caches when it is hashed (O_DIRECT reads take the payload in one
call). docs/store.md has the measurements."""
MAX_PAYLOAD_BYTES = 1 << 30
"""Files larger than this are not blocks (a 256-token block of a 70B model is ~80 MiB)."""
VOLUME_FILE = "volume.json"
"""The volume identity file, in the root's control directory (`.kvtier/`)."""
VOLUME_CHECK_S = 1.0
"""How often, at most, the tier checks that its root is still the shared volume."""
_VOLUME_RECHECK_ID_S = 30.0
"""How often the identity file is read even while the device id is unchanged."""
# link() errors meaning "this filesystem cannot hard-link", not "the write failed".
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}
_NO_NOREPLACE: set[int | None] = set()
"""Devices (None: publishes that named none) where `rename_noreplace` was refused: they link."""


def _write_all(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _read_into(
    fd: int,
    view: memoryview,
    hasher: xxhash.xxh3_64 | None = None,
    times: ReadTimes | None = None,
    chunk: int = READ_CHUNK_BYTES,
) -> int:
    """Fill `view` from `fd` in `chunk`-byte pieces, hashing each piece right after it is read,
    while it is still in the CPU cache (a separate pass would read the whole payload from
    memory a second time). Returns the bytes read; short only at EOF. `times` gets the read and
    hash seconds (two clock reads per piece: ~0.1 us against ~50 us of copying)."""
    done = 0
    clock = time.perf_counter
    while done < view.nbytes:
        t0 = clock()
        n = os.readv(fd, [view[done : done + chunk]])
        t1 = clock()
        if n == 0:
            break
        if hasher is not None:
            hasher.update(view[done : done + n])
        if times is not None:
            times.read_s += t1 - t0
            times.checksum_s += clock() - t1
        done += n
    return done


def mount_table() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount in /proc/mounts, in its order."""
    with open("/proc/mounts", encoding="utf-8") as mounts:
        return [
            (fields[1].replace("\\040", " "), fields[2])
            for fields in (line.split() for line in mounts)
        ]


def file_system_of(path: str) -> str | None:
    """The type of the file system `path` lies on (the deepest mount point above it in
    /proc/mounts); None where that cannot be told."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        table = mount_table()
    except OSError:
        return None
    for point, fs_type in table:
        inside = path == point or path.startswith(point.rstrip(os.sep) + os.sep)
        if inside and len(point) >= len(best):
            best, kind = point, fs_type
    return kind


def publish(
    path: str, views: list[memoryview], mode: int = 0o600, device: int | None = None
) -> bool:
    """Atomically create `path` (permissions `mode`) with the concatenation of `views`.

    Returns True if this call created it, False if it already existed (another writer won).
    Raises OSError on a real I/O failure, and ENODEV when the file would land on another
    device than `device` (the volume is not mounted there any more).
    """
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    moved = False  # the temp name is gone (renamed): nothing to unlink
    try:
        try:
            if device is not None and os.fstat(fd).st_dev != device:
                raise OSError(errno.ENODEV, "L2 volume not mounted", path)
            _write_all(fd, list(views))
        finally:
            os.close(fd)
        if device not in _NO_NOREPLACE:
            try:
                rename_noreplace(tmp, path)  # one metadata operation where link + unlink are two
                moved = True
                return True
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in UNSUPPORTED:
                    raise
                _NO_NOREPLACE.add(device)
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
        moved = True
        return True
    finally:
        if not moved:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


class _Volume:
    """The shared volume under a tier's root: its identity and device (module docstring)."""

    def __init__(self, root: str, mode: int, clock: Callable[[], float]) -> None:
        self._root = root
        self._file = control_dir(root, VOLUME_FILE)
        self._clock = clock
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(self._file), mode=_dir_mode(mode), exist_ok=True)
        _refuse_symlink(root, CONTROL_DIR)
        if not os.path.exists(self._file):
            doc = {"volume": uuid.uuid4().hex, "created": time.time()}
            publish(self._file, [memoryview(json.dumps(doc).encode() + b"\n")], mode | 0o444)
        self.id = self._read_id()
        if self.id is None:
            raise OSError(errno.EINVAL, "unreadable volume identity", self._file)
        st = os.stat(root)
        self.device, self._inode = st.st_dev, st.st_ino
        self.usable = True
        self._checked = self._id_checked = clock()

    def _read_id(self) -> str | None:
        try:
            with open(self._file, "rb") as f:
                found = json.loads(f.read(4096)).get("volume")
        except (OSError, ValueError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    def check(self, *, now: bool = False) -> bool:
        """Whether the root is still the volume (re-checked at most every `VOLUME_CHECK_S`;
        with `now`, at once and by its identity file). Logs when L2 becomes unusable and when
        it resumes."""
        t = self._clock()
        if not now and t - self._checked < VOLUME_CHECK_S:
            return self.usable
        with self._lock:
            self._checked = t
            try:
                st = os.stat(self._root)
                same = (
                    not now
                    and (st.st_dev, st.st_ino) == (self.device, self._inode)
                    and t - self._id_checked < _VOLUME_RECHECK_ID_S
                )
                if not same or not self.usable:
                    same = self._read_id() == self.id
                    self._id_checked = t
                reason = "" if same else "the root holds no identity file of this volume"
            except OSError as exc:
                same, reason = False, str(exc)
            if same:
                self.device, self._inode = st.st_dev, st.st_ino
            if same != self.usable:
                self.usable = same
                if same:
                    log.warning("kvtier L2: volume %s is back under %s", self.id, self._root)
                else:
                    log.warning(
                        "kvtier L2: %s is no longer the shared volume %s (%s: unmounted?); "
                        "L2 is unusable (misses, no writes) until it is back",
                        self._root,
                        self.id,
                        reason,
                    )
            return self.usable


def _refuse_symlink(root: str, name: str) -> None:
    """Raise `OSError` unless `<root>/<name>` is a directory itself: a symlink planted there
    would take the tier's writes out of the shared root (the janitor refuses them too)."""
    if not real_dir(root, name):
        raise OSError(errno.ELOOP, "not a directory (a symlink?)", os.path.join(root, name))


def _dir_mode(file_mode: int) -> int:
    """Directory permissions for `file_mode`: search permission wherever it grants read."""
    return file_mode | (file_mode & 0o444) >> 2


class OpenedBlock:
    """One L2 block file opened (`PosixTier.open_block`): read its payload in order, in pieces
    (`read_at`) or whole (`fd`, `hasher`), then `finish` (checksum verified, the hit counted) or
    `abandon`; either closes the file. Opened for pieces, its header comes with the first
    piece (`meta` is None until then)."""

    def __init__(
        self,
        tier: PosixTier,
        block_hash: BlockHash,
        path: str,
        fd: int,
        opened: os.stat_result,
        header: Header | None,
    ) -> None:
        self._tier = tier
        self.block_hash = block_hash
        self._path = path
        self.fd = fd
        self.opened = opened
        self._header = header
        self.meta = None if header is None else header.meta
        self.payload_bytes = opened.st_size - HEADER_BYTES
        self.hasher = xxhash.xxh3_64()
        """Hashes the payload as it is read."""
        self._done = 0
        self._closed = False

    def read_at(self, offset: int, out: memoryview) -> None:
        """Read payload bytes `offset`.. into `out` and hash them; pieces must come in payload
        order, each once. The first piece of a block opened for pieces brings its header, then
        validated (`meta` set). Raises OSError (a short read: EIO) or CodecError (an invalid
        header: the file is removed)."""
        if offset != self._done:
            raise ValueError(f"payload pieces out of order: {offset}, expected {self._done}")
        if self._header is None:
            head = memoryview(bytearray(HEADER_BYTES))
            got = os.preadv(self.fd, [head, out], 0) - HEADER_BYTES
            try:
                self._header = self._tier._checked_header(
                    head, self.block_hash, self.opened.st_size
                )
            except CodecError as exc:
                self._tier._invalid(self.block_hash, self._path, self.opened, exc)
                self._close()
                raise
            self.meta = self._header.meta
        else:
            got = os.preadv(self.fd, [out], HEADER_BYTES + offset)
        if got != out.nbytes:
            raise OSError(errno.EIO, f"short read: {got} of {out.nbytes} bytes", self._path)
        self.hasher.update(out)
        self._done += got

    def finish(self, read_bytes: int | None = None) -> bool:
        """Check what was read (`read_bytes`, default: the pieces read) against the header:
        True counts a hit (and records the access), False an invalid block (its file is
        removed)."""
        nbytes = self._done if read_bytes is None else read_bytes
        try:
            if self._header is None:
                raise CodecError("header: not read")
            verify_read(self._header, nbytes, self.hasher.intdigest())
        except CodecError as exc:
            self._tier._invalid(self.block_hash, self._path, self.opened, exc)
            return False
        else:
            self._tier._hit(self)
            return True
        finally:
            self._close()

    def abandon(self) -> None:
        """Give up on the block (a miss; the file is left alone); nothing once closed."""
        if not self._closed:
            self._close()
            self._tier._counters.add(misses=1)

    def _close(self) -> None:
        self._closed = True
        try:
            os.close(self.fd)
        except OSError:  # (nothing was written: nothing to lose)
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
        file_mode: int = 0o600,
        direct_reads: bool = False,
        piece_reads: frozenset[str] = frozenset(),
    ) -> None:
        """`access` records read hits in the shared access record the capacity janitor evicts
        by (`kvtier.core.tiers.janitor`); None records nothing. `file_mode`: permissions of
        the files created (directories get search permission where it grants read).
        `direct_reads`: open files to read with O_DIRECT; a file system that refuses it (EINVAL)
        turns it off for this tier, with a warning. `piece_reads`: the file systems on which
        readers may read a block in pieces beside the forward pass (`open_block`; the
        profile's)."""
        if not NAMESPACE.fullmatch(namespace):
            raise TierError(f"namespace: {namespace!r} is not a hex digest")
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
        self._file_mode = file_mode
        self._read_flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct_reads else 0)
        fs_type = file_system_of(root) if piece_reads else None
        self.piece_reads = fs_type in piece_reads
        """Whether readers should read blocks in pieces: only on a file system the profile
        names, whatever the profile claims the directory is."""
        if piece_reads and not self.piece_reads:
            log.info(
                "kvtier: L2 %s is on %s, not %s: blocks are read whole, before the forward "
                "pass (set l2_profile to match it)",
                root,
                fs_type,
                " or ".join(sorted(piece_reads)),
            )
        self._dir_mode = _dir_mode(file_mode)
        try:
            self._volume = _Volume(root, file_mode, clock)
            os.makedirs(self._dir, mode=self._dir_mode, exist_ok=True)
            _refuse_symlink(root, os.path.basename(self._dir))
            body = json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n"
            manifest_path = os.path.join(self._dir, MANIFEST)
            if not os.path.exists(manifest_path):
                publish(manifest_path, [memoryview(body)], file_mode)
            probe = os.path.join(self._dir, f".probe.{uuid.uuid4().hex}.tmp")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode))
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

    @property
    def usable(self) -> bool:
        """Whether the root is (still, or again) the shared volume (see the module docstring)."""
        return self._volume.check()

    def _unusable(self, **counts: int) -> bool:
        """True (and the call counted as a fault) while the volume is not there."""
        if self._volume.check():
            return False
        self._counters.add(errors=1, **counts)
        return True

    def contains(self, block_hash: BlockHash) -> bool:
        if self._unusable():
            return False
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
        if self._unusable():
            return PutResult(stored=False)
        try:
            if os.path.exists(path):
                self._counters.add(already_present=1)
                self._remember(block_hash, True)
                return PutResult(stored=False)
            view = byte_view(payload)
            header = encode_header(self._namespace, block_hash, meta, view)
            created = self._publish(path, [memoryview(header), view])
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                self._volume.check(now=True)
            self._fault("write", exc)
            return PutResult(stored=False)
        self._remember(block_hash, True)
        if created:
            self._counters.add(stored=1, bytes_written=view.nbytes)
        else:
            self._counters.add(already_present=1)
        return PutResult(stored=created)

    def _publish(self, path: str, views: list[memoryview]) -> bool:
        """`publish` into `path`'s directory, made first if needed. ENOENT means a directory
        made before was removed since (an operator wiped L2): it is made again, once."""
        directory = os.path.dirname(path)
        self._ensure_dir(directory)
        try:
            return publish(path, views, self._file_mode, self._volume.device)
        except FileNotFoundError:
            with self._lock:
                self._made_dirs.discard(directory)
            self._ensure_dir(directory)
            return publish(path, views, self._file_mode, self._volume.device)

    def _ensure_dir(self, directory: str) -> None:
        """Make `directory` (a fan-out directory), unless this tier made it before; raises
        ENODEV instead while the root is not the volume (never creates on a bare root)."""
        if directory not in self._made_dirs:
            if not self._volume.check(now=True):
                raise OSError(errno.ENODEV, "L2 volume not mounted", directory)
            # makedirs' mode applies to the leaf only: each level is made on its own
            for level in (self._dir, os.path.dirname(directory), directory):
                os.makedirs(level, mode=self._dir_mode, exist_ok=True)
            with self._lock:
                self._made_dirs.add(directory)

    # ---- read ---------------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> StoredBlock | None:
        read = self._read(block_hash, None, None)
        return None if read is None else StoredBlock(read[0], read[1].toreadonly())

    def read_into(
        self, block_hash: BlockHash, out: memoryview, times: ReadTimes | None = None
    ) -> BlockMeta | None:
        """The payload into `out` (see `ReadsInto`): no buffer is allocated per read."""
        read = self._read(block_hash, out, times)
        return None if read is None else read[0]

    def open_block(self, block_hash: BlockHash, payload_bytes: int) -> OpenedBlock | None:
        """The block's file opened, its size that of a header and `payload_bytes`, to read in
        pieces, its header with the first (`OpenedBlock`): one round trip fewer over a network
        file system. None: a miss (counted; a file of another size is left alone)."""
        return self._open_block(block_hash, payload_bytes)

    def _read(
        self, block_hash: BlockHash, out: memoryview | None, times: ReadTimes | None
    ) -> tuple[BlockMeta, memoryview] | None:
        """Open, validate and read one block into `out` (None: a fresh buffer of its own)."""
        start = time.perf_counter()
        block = self._open_block(block_hash)
        if block is None:
            return None
        if out is None:
            # Its own buffer, so L1 holds exactly the payload after promotion; uninitialised,
            # since the read overwrites every byte (bytearray would zero it).
            payload = np.empty(block.payload_bytes, dtype=np.uint8).data
        elif out.nbytes == block.payload_bytes:
            payload = out
        else:  # the caller expects another layout: not this file's fault, leave it
            block.abandon()
            return None
        if times is not None:
            times.open_s += time.perf_counter() - start
        # O_DIRECT: the whole payload in one call, which a FUSE client answers with fewer
        # round trips through its daemon (each costs two context switches); the hash then
        # runs after the read, at memory speed, far below the FUSE transfer rate.
        chunk = payload.nbytes if self._read_flags & os.O_DIRECT else READ_CHUNK_BYTES
        try:
            got = _read_into(block.fd, payload, block.hasher, times, chunk)
        except OSError as exc:
            if not self._direct_refused(exc):
                self._fault("read", exc)
            block.abandon()
            return None
        assert block.meta is not None  # (opened with its header)
        return (block.meta, payload) if block.finish(got) else None

    def _open_block(
        self, block_hash: BlockHash, payload_bytes: int | None = None
    ) -> OpenedBlock | None:
        """Open the block's file; its header read and validated now unless `payload_bytes`
        (then the file's size is checked against it, the header left to the first read; a file
        of another size is checked now, and removed unless its header explains the size)."""
        if self._unusable(misses=1):
            return None
        path = self.path(block_hash)
        try:
            fd = self._open_to_read(path)
        except FileNotFoundError:
            self._remember(block_hash, False)
            self._counters.add(misses=1)
            return None
        except OSError as exc:
            self._fault("open", exc)
            self._counters.add(misses=1)
            return None
        opened: os.stat_result | None = None
        try:
            try:
                opened = os.fstat(fd)
                if opened.st_dev != self._volume.device and not self._volume.check(now=True):
                    raise OSError(errno.ENODEV, "L2 volume not mounted", path)
                size = opened.st_size
                if payload_bytes is not None and size == HEADER_BYTES + payload_bytes:
                    return OpenedBlock(self, block_hash, path, fd, opened, None)
                if not HEADER_BYTES <= size <= HEADER_BYTES + MAX_PAYLOAD_BYTES:
                    raise CodecError(f"file: {size} bytes is not a plausible block")
                head = memoryview(bytearray(HEADER_BYTES))
                got = _read_into(fd, head)
                header = self._checked_header(head[:got], block_hash, size)
                if payload_bytes is not None:  # a sound block of another layout: leave it
                    os.close(fd)
                    self._counters.add(misses=1)
                    return None
            except BaseException:
                os.close(fd)  # whatever failed, and before the file may be removed
                raise
        except CodecError as exc:
            assert opened is not None  # (fstat raises OSError)
            self._invalid(block_hash, path, opened, exc)
            return None
        except OSError as exc:
            if not self._direct_refused(exc):
                self._fault("read", exc)
            self._counters.add(misses=1)
            return None
        return OpenedBlock(self, block_hash, path, fd, opened, header)

    def _checked_header(self, head: memoryview, block_hash: BlockHash, size: int) -> Header:
        """The header of `block_hash`'s file of `size` bytes; CodecError unless valid."""
        header = decode_header(head, namespace=self._namespace, block_hash=block_hash)
        if size != HEADER_BYTES + header.payload_bytes:
            raise CodecError(
                f"file: {size} bytes, header says {HEADER_BYTES} + {header.payload_bytes}"
            )
        return header

    def _invalid(
        self, block_hash: BlockHash, path: str, opened: os.stat_result, why: CodecError
    ) -> None:
        self._discard(path, opened, why)
        self._remember(block_hash, False)
        self._counters.add(misses=1, corrupt_removed=1)

    def _hit(self, block: OpenedBlock) -> None:
        if self._access is not None:  # on the open fd: the very inode that was read
            self._access.record(block.fd, block.opened.st_mtime)
        self._remember(block.block_hash, True)
        self._counters.add(hits=1, bytes_read=block.payload_bytes)

    def _open_to_read(self, path: str) -> int:
        try:
            return os.open(path, self._read_flags)
        except OSError as exc:
            if not self._direct_refused(exc):
                raise
        return os.open(path, self._read_flags)

    def _direct_refused(self, exc: OSError) -> bool:
        """Whether `exc` is the file system refusing O_DIRECT (at open, or at a read whose buffer
        it wants aligned); if so, reads go through the page cache from now on."""
        if exc.errno != errno.EINVAL or not self._read_flags & os.O_DIRECT:
            return False
        self._read_flags &= ~os.O_DIRECT
        log.warning(
            "kvtier: L2 %s refuses O_DIRECT reads: reading through the page cache", self._dir
        )
        return True

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
        if self._unusable():
            return False
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
