"""L2 on a shared directory: layout, atomic multi-writer publish, validation, degradation."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from kvtier.core.codec import HEADER_BYTES
from kvtier.core.errors import CodecError, TierError
from kvtier.core.keys import BlockHash, Namespace
from kvtier.core.settings import StoreSettings
from kvtier.core.tiers import posix
from kvtier.core.tiers.janitor import AccessRecorder
from kvtier.core.tiers.noreplace import rename_noreplace
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.profiles import get_profile
from kvtier.core.tiers.shared import open_shared_l2
from tests.helpers.l2 import IDENTITY
from tests.helpers.tiers import NAMESPACE, hash_of, meta_for, payload_for, variant_payload

REPO = Path(__file__).resolve().parents[3]
MANIFEST = {"namespace": NAMESPACE, "identity": {"model": "test"}}
NBYTES = 64 * 1024


def tier_in(root: Path, namespace: Namespace = NAMESPACE) -> PosixTier:
    return PosixTier(str(root), namespace, MANIFEST, exists_ttl_s=0)


def put(tier: PosixTier, name: str, nbytes: int = NBYTES) -> BlockHash:
    h = hash_of(name)
    tier.put(h, meta_for(nbytes), payload_for(h, nbytes))
    return h


def files(root: Path, pattern: str) -> list[Path]:
    return sorted(root.rglob(pattern))


def test_block_lands_at_its_fan_out_path_with_a_manifest(tmp_path: Path) -> None:
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    hex_ = h.hex()
    expected = tmp_path / NAMESPACE / hex_[0:2] / hex_[2:4] / f"{hex_}.kvt"
    assert files(tmp_path, "*.kvt") == [expected]
    assert expected.stat().st_size == HEADER_BYTES + NBYTES
    assert json.loads((tmp_path / NAMESPACE / "manifest.json").read_text()) == MANIFEST
    assert files(tmp_path, "*.tmp") == []


@pytest.mark.parametrize("planted", [".kvtier", NAMESPACE])
def test_a_symlink_planted_in_the_root_is_refused_and_nothing_written_through_it(
    tmp_path: Path, planted: str
) -> None:
    root, elsewhere = tmp_path / "l2", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / planted).symlink_to(elsewhere)
    with pytest.raises(TierError, match="a symlink"):
        tier_in(root)
    assert list(elsewhere.iterdir()) == []


def test_round_trip_returns_the_bytes_and_meta_read_only(tmp_path: Path) -> None:
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    block = tier.get(h)
    assert block is not None
    assert bytes(block.payload) == payload_for(h, NBYTES)
    assert block.meta == meta_for(NBYTES)
    assert block.payload.readonly
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_read, stats.bytes_written) == (
        1,
        0,
        NBYTES,
        NBYTES,
    )


def test_an_opened_block_is_read_in_pieces_in_order_and_verified(tmp_path: Path) -> None:
    """`open_block` checks the file's size; the first piece brings the header; pieces read in
    order, then `finish`, make a hit; a piece out of order is refused; a payload whose checksum
    fails is a miss, and removed."""
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    opened = tier.open_block(h, NBYTES)
    assert opened is not None and opened.meta is None
    pieces = [bytearray(NBYTES // 4) for _ in range(4)]
    with pytest.raises(ValueError, match="out of order"):
        opened.read_at(NBYTES // 4, memoryview(pieces[1]))
    for i, piece in enumerate(pieces):
        opened.read_at(i * len(piece), memoryview(piece))
        assert opened.meta == meta_for(NBYTES)
    assert b"".join(pieces) == payload_for(h, NBYTES)
    assert opened.finish()
    assert (tier.stats().hits, tier.stats().bytes_read) == (1, NBYTES)

    opened = tier.open_block(h, NBYTES)
    assert opened is not None
    path = Path(tier.path(h))
    with path.open("r+b") as f:  # bit rot after the file was opened
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if payload_for(h, NBYTES)[-1] else b"\x01")
    opened.read_at(0, memoryview(bytearray(NBYTES)))
    assert not opened.finish()
    assert tier.stats().corrupt_removed == 1 and not path.exists()


def test_an_opened_block_with_a_bad_header_is_removed_at_its_first_piece(
    tmp_path: Path,
) -> None:
    """A header that fails validation when the first piece brings it raises CodecError, and the
    file is removed; a file of another size is not opened and stays (another layout's)."""
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    path = Path(tier.path(h))
    with path.open("r+b") as f:
        f.write(b"XXXX")  # the magic
    opened = tier.open_block(h, NBYTES)
    assert opened is not None
    with pytest.raises(CodecError):
        opened.read_at(0, memoryview(bytearray(NBYTES // 2)))
    assert tier.stats().corrupt_removed == 1 and not path.exists()
    opened.abandon()  # (already closed: nothing more counted)
    assert tier.stats().misses == 1

    other = put(tier, "b")
    assert tier.open_block(other, NBYTES * 2) is None
    assert Path(tier.path(other)).exists() and tier.stats().misses == 2


@pytest.mark.parametrize("keep", [NBYTES // 2, 0], ids=["torn", "empty"])
def test_an_opened_block_of_a_size_its_header_does_not_explain_is_removed(
    tmp_path: Path, keep: int
) -> None:
    """A file torn short (a crash before its data reached the disk) is not another layout's:
    opening it for pieces removes it, so the next save of the block writes it whole again
    (before, the file stayed, every lookup offered it and every load of it failed)."""
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    path = Path(tier.path(h))
    path.write_bytes(path.read_bytes()[:keep])
    assert tier.open_block(h, NBYTES) is None
    assert not path.exists() and tier.stats().corrupt_removed == 1
    assert put(tier, "a") == h and tier.open_block(h, NBYTES) is not None


def test_a_read_into_a_buffer_removes_damaged_files_and_leaves_other_layouts(
    tmp_path: Path,
) -> None:
    """`read_into` a buffer: a bad header, or a file torn short of what its header says, is
    removed; a valid block whose payload is not the buffer's size (another layout's) stays."""
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    out = memoryview(bytearray(NBYTES))
    assert tier.read_into(h, out) == meta_for(NBYTES) and bytes(out) == payload_for(h, NBYTES)

    assert tier.read_into(h, memoryview(bytearray(NBYTES // 2))) is None  # another layout
    assert Path(tier.path(h)).exists() and tier.stats().corrupt_removed == 0

    bad = put(tier, "b")
    with Path(tier.path(bad)).open("r+b") as f:
        f.write(b"XXXX")  # the magic
    assert tier.read_into(bad, out) is None
    assert not Path(tier.path(bad)).exists() and tier.stats().corrupt_removed == 1

    torn = put(tier, "c")
    path = Path(tier.path(torn))
    path.write_bytes(path.read_bytes()[:-1])
    assert tier.read_into(torn, out) is None
    assert not path.exists() and tier.stats().corrupt_removed == 2
    assert (tier.stats().hits, tier.stats().misses) == (1, 3)


def test_blocks_are_read_in_pieces_only_on_the_file_systems_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces are read where the directory lies on a file system the profile names (a local
    disk for `local`, JuiceFS's FUSE client for `juicefs`), on no other (a JuiceFS or NFS mount
    named with the default profile, say, reads blocks whole); with O_DIRECT on a file system
    that needs aligned reads, never."""
    assert posix.file_system_of("/proc") == "proc"
    local = get_profile("local").piece_reads
    assert PosixTier(str(tmp_path), NAMESPACE, MANIFEST, piece_reads=local).piece_reads
    assert not PosixTier(str(tmp_path), NAMESPACE, MANIFEST).piece_reads
    monkeypatch.setattr(posix, "file_system_of", lambda path: "fuse.juicefs")
    assert not PosixTier(str(tmp_path), NAMESPACE, MANIFEST, piece_reads=local).piece_reads
    juicefs = get_profile("juicefs").piece_reads
    assert PosixTier(str(tmp_path), NAMESPACE, MANIFEST, piece_reads=juicefs).piece_reads
    monkeypatch.setattr(posix, "file_system_of", lambda path: "nfs4")
    assert not PosixTier(str(tmp_path), NAMESPACE, MANIFEST, piece_reads=juicefs).piece_reads


def test_pieces_are_not_read_with_o_direct_where_it_needs_alignment(tmp_path: Path) -> None:
    """`open_shared_l2`: the local profile reads pieces, but not with O_DIRECT reads, which a
    local disk wants aligned; the juicefs profile's O_DIRECT needs no alignment."""

    def reads_pieces(direct: bool | None) -> bool:
        config = StoreSettings(l2_path=str(tmp_path), l2_profile="local", l2_direct_reads=direct)
        shared = open_shared_l2(config, IDENTITY)
        assert shared is not None and isinstance(shared.tier, PosixTier)
        try:
            return shared.tier.piece_reads
        finally:
            shared.close()

    assert reads_pieces(None)
    assert not reads_pieces(True)


def test_second_put_of_a_block_is_skipped(tmp_path: Path) -> None:
    first, second = tier_in(tmp_path), tier_in(tmp_path)
    h = put(first, "a")
    result = second.put(h, meta_for(NBYTES), b"\0" * NBYTES)
    assert not result.stored
    block = first.get(h)
    assert block is not None and bytes(block.payload) == payload_for(h, NBYTES)
    assert second.stats().already_present == 1


def test_lost_link_race_is_success_and_leaves_no_temp_file(tmp_path: Path) -> None:
    """Another writer publishing between our existence check and our link: EEXIST wins."""
    target = tmp_path / "blk.kvt"
    target.write_bytes(b"winner")
    assert posix.publish(str(target), [memoryview(b"loser")]) is False
    assert target.read_bytes() == b"winner"
    assert list(tmp_path.iterdir()) == [target]


def test_publish_falls_back_to_rename_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_link(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    def no_noreplace(src: str, dst: str) -> None:
        raise OSError(errno.EINVAL, "RENAME_NOREPLACE not supported", dst)

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(posix, "rename_noreplace", no_noreplace)
    monkeypatch.setattr(posix, "_NO_NOREPLACE", set())
    target = tmp_path / "blk.kvt"
    assert posix.publish(str(target), [memoryview(b"abc"), memoryview(b"def")]) is True
    assert target.read_bytes() == b"abcdef"
    assert posix.publish(str(target), [memoryview(b"xyz")]) is False
    assert target.read_bytes() == b"abcdef"
    assert list(tmp_path.iterdir()) == [target]


def test_missing_block_is_a_miss(tmp_path: Path) -> None:
    tier = tier_in(tmp_path)
    assert tier.get(hash_of("nope")) is None
    assert not tier.contains(hash_of("nope"))
    assert tier.stats().misses == 1


def _rewrite_header(path: Path, offset: int, fmt: str, value: int | bytes) -> None:
    """Patch one header field and re-seal the header checksum, so only that field is wrong."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    struct.pack_into("<Q", data, 184, xxhash.xxh3_64_intdigest(bytes(data[:184])))
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(HEADER_BYTES + NBYTES // 2)


def _flip_payload_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 1234] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_header_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[81] ^= 0x01  # inside num_tokens
    path.write_bytes(bytes(data))


def _wrong_version(path: Path) -> None:
    _rewrite_header(path, 8, "<H", 2)


def _header_only(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(HEADER_BYTES)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_payload_bit, _flip_header_bit, _wrong_version, _header_only, _empty]
)
def test_damaged_file_is_a_miss_and_is_removed(tmp_path: Path, damage) -> None:
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    path = Path(tier.path(h))
    damage(path)
    assert tier.get(h) is None
    assert not path.exists()
    stats = tier.stats()
    assert (stats.misses, stats.corrupt_removed, stats.hits) == (1, 1, 0)
    put(tier, "a")  # and the block can be published again
    assert tier.get(h) is not None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_header_with_a_non_ascii_dtype_is_a_removed_miss_and_leaks_no_fd(
    tmp_path: Path,
) -> None:
    tier = tier_in(tmp_path)
    hashes = [put(tier, name) for name in ("a", "b", "c")]
    _rewrite_header(Path(tier.path(hashes[2])), 84, "<16s", b"\xffint8")  # checksum still valid
    fds = _open_fds()
    blocks = tier.get_many(hashes)
    assert [b is not None for b in blocks] == [True, True, False]
    assert not os.path.exists(tier.path(hashes[2]))
    for _ in range(20):
        tier.get_many(hashes)
    assert _open_fds() == fds
    stats = tier.stats()
    assert (stats.corrupt_removed, stats.misses, stats.hits) == (1, 21, 42)


def test_an_unexpected_error_reading_a_header_still_closes_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tier_in(tmp_path)
    h = put(tier, "a")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(posix, "decode_header", broken)
    fds = _open_fds()
    for _ in range(5):
        with pytest.raises(RuntimeError):
            tier.get(h)
    assert _open_fds() == fds


def test_block_of_another_namespace_is_rejected_and_removed(tmp_path: Path) -> None:
    other = tier_in(tmp_path, Namespace("ffffffffffffffff"))
    tier = tier_in(tmp_path)
    h = put(other, "a")
    path = Path(tier.path(h))
    path.parent.mkdir(parents=True)
    shutil.copy(other.path(h), path)
    assert tier.get(h) is None
    assert not path.exists()
    assert tier.stats().corrupt_removed == 1
    assert other.get(h) is not None  # the other namespace's copy is untouched


def test_file_holding_another_block_is_rejected(tmp_path: Path) -> None:
    tier = tier_in(tmp_path)
    a, b = put(tier, "a"), hash_of("b")
    Path(tier.path(b)).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(tier.path(a), tier.path(b))
    assert tier.get(b) is None
    assert tier.stats().corrupt_removed == 1


def test_missing_root_is_refused_not_created(tmp_path: Path) -> None:
    with pytest.raises(TierError, match="does not exist"):
        tier_in(tmp_path / "not-mounted")
    assert not (tmp_path / "not-mounted").exists()


def test_root_below_a_regular_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(TierError):
        tier_in(tmp_path / "file" / "l2")


def test_immutable_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    chattr = shutil.which("chattr")
    if (
        chattr is None
        or subprocess.run([chattr, "+i", str(root)], check=False, capture_output=True).returncode
        != 0
    ):
        pytest.skip("chattr +i is not available on this file system")
    try:
        with pytest.raises(TierError, match="not writable"):
            tier_in(root)
    finally:
        subprocess.run([chattr, "-i", str(root)], check=True)


def test_directory_vanishing_later_turns_puts_into_counted_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tier_in(tmp_path)
    h = put(tier, "a")
    shutil.rmtree(tmp_path / NAMESPACE)
    (tmp_path / NAMESPACE).write_bytes(b"not a directory any more")
    with caplog.at_level(logging.WARNING, logger="kvtier.core.tiers.posix"):
        result = tier.put(hash_of("b"), meta_for(NBYTES), payload_for(hash_of("b"), NBYTES))
        assert tier.get(h) is None
    assert not result.stored
    assert tier.stats().errors == 2
    assert "treating it as a miss" in caplog.text


def test_directories_removed_under_the_tier_are_made_again_on_the_volume_only(
    tmp_path: Path,
) -> None:
    """An operator wipes `<root>/<ns>`: the next put into a fan-out directory the tier made
    before makes it again; with the volume identity gone too, it creates nothing."""
    tier = tier_in(tmp_path)
    a = put(tier, "a")
    b = BlockHash(a[:2] + hash_of("b")[2:])  # a's fan-out directories
    c = BlockHash(a[:2] + hash_of("c")[2:])
    shutil.rmtree(tier.directory)
    assert tier.put(b, meta_for(NBYTES), payload_for(b, NBYTES)).stored
    assert tier.get(b) is not None and tier.stats().errors == 0
    shutil.rmtree(tmp_path / NAMESPACE)
    shutil.rmtree(tmp_path / ".kvtier")  # not the volume any more: a bare directory
    assert not tier.put(c, meta_for(NBYTES), payload_for(c, NBYTES)).stored
    assert os.listdir(tmp_path) == [] and tier.stats().errors == 1


def test_contains_answers_are_cached_for_the_ttl(tmp_path: Path) -> None:
    now = [0.0]
    tier = PosixTier(str(tmp_path), NAMESPACE, MANIFEST, exists_ttl_s=1.0, clock=lambda: now[0])
    h = hash_of("a")
    assert not tier.contains(h)
    writer = tier_in(tmp_path)
    put(writer, "a")
    assert not tier.contains(h)  # still the cached answer
    now[0] = 1.5
    assert tier.contains(h)
    assert tier.contains_many([h, hash_of("b")]) == [True, False]


def test_concurrent_processes_never_read_torn_blocks(tmp_path: Path) -> None:
    """Three processes publish, remove and read the same 12 blocks for 300 rounds each."""
    writers, rounds, blocks, nbytes = 3, 300, 12, 256 * 1024
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.posix_worker",
                str(tmp_path),
                str(w),
                str(writers),
                str(rounds),
                str(blocks),
                str(nbytes),
                str(1000 + w),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(writers)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    assert [r["bad"] for r in reports] == [0] * writers
    assert [r["corrupt_removed"] for r in reports] == [0] * writers
    assert [r["errors"] for r in reports] == [0] * writers
    assert sum(r["hits"] for r in reports) > 0
    reader = tier_in(tmp_path)
    for i in range(blocks):
        h = hash_of(f"block-{i}")
        block = reader.get(h)
        assert block is not None, f"block {i} unreadable"
        assert bytes(block.payload) in {variant_payload(h, w, nbytes) for w in range(writers)}
    assert files(tmp_path, "*.tmp") == []


def test_a_read_hit_refreshes_a_stale_access_record_and_a_bad_read_does_not(tmp_path: Path) -> None:
    recorder = AccessRecorder(touch_interval_s=60.0)
    tier = PosixTier(str(tmp_path), NAMESPACE, MANIFEST, exists_ttl_s=0, access=recorder)
    good, bad = put(tier, "read-often"), put(tier, "bit-rot")
    for h in (good, bad):
        os.utime(tier.path(h), (1000.0, 1000.0))  # last used long ago
    with open(tier.path(bad), "r+b") as f:
        f.seek(HEADER_BYTES + 7)
        f.write(b"\xff")
    assert tier.get(good) is not None
    assert os.stat(tier.path(good)).st_mtime > 1000.0 and recorder.touches == 1
    assert tier.get(good) is not None and recorder.touches == 1  # fresh now: no second touch
    assert tier.get(bad) is None and recorder.touches == 1


@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_a_file_system_refusing_direct_reads_falls_back_to_the_page_cache(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    refused_at: str,
) -> None:
    """EINVAL for O_DIRECT (at open, or at a read into an unaligned buffer) turns direct reads
    off for the tier, with one warning; at open the read still hits, at a read it misses once."""
    writer = tier_in(tmp_path)
    a, b = put(writer, "a"), put(writer, "b")
    reader = PosixTier(str(tmp_path), NAMESPACE, MANIFEST, exists_ttl_s=0, direct_reads=True)
    real_open, real_readv = os.open, os.readv
    direct_fds: set[int] = set()

    def open_(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        fd = real_open(path, flags & ~os.O_DIRECT, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def readv(fd: int, buffers: list[memoryview]) -> int:
        if fd in direct_fds:
            direct_fds.discard(fd)  # the tier closes it; its number is reused
            raise OSError(errno.EINVAL, "unaligned")
        return real_readv(fd, buffers)

    monkeypatch.setattr("kvtier.core.tiers.posix.os.open", open_)
    monkeypatch.setattr("kvtier.core.tiers.posix.os.readv", readv)
    with caplog.at_level(logging.WARNING):
        first = reader.get(a)
        second = reader.get(b)
    assert (first is not None) == (refused_at == "open")
    assert second is not None and bytes(second.payload) == bytes(payload_for(b, NBYTES))
    assert [r.message for r in caplog.records].count(
        f"kvtier: L2 {tmp_path / NAMESPACE} refuses O_DIRECT reads: reading through the page cache"
    ) == 1
    assert reader.stats().errors == 0


def test_publish_renames_into_place_in_one_operation_where_supported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No hard link and no unlink of the temp name when RENAME_NOREPLACE works (ext4/tmpfs)."""
    calls: list[str] = []

    def recorded(name: str) -> Callable[..., None]:
        real = getattr(os, name)

        def call(*args: str) -> None:
            calls.append(name)
            real(*args)

        return call

    for name in ("link", "unlink"):
        monkeypatch.setattr(os, name, recorded(name))
    target = tmp_path / "blk.kvt"
    assert posix.publish(str(target), [memoryview(b"abc")]) is True
    assert posix.publish(str(target), [memoryview(b"xyz")]) is False  # taken: the temp goes
    assert target.read_bytes() == b"abc" and list(tmp_path.iterdir()) == [target]
    assert calls == ["unlink"]


def test_publish_links_where_rename_noreplace_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: list[str] = []

    def refuse(src: str, dst: str) -> None:
        refused.append(dst)
        raise OSError(errno.EINVAL, "RENAME_NOREPLACE not supported", dst)

    monkeypatch.setattr(posix, "rename_noreplace", refuse)
    monkeypatch.setattr(posix, "_NO_NOREPLACE", set())
    device = os.stat(tmp_path).st_dev
    first, second = tmp_path / "a.kvt", tmp_path / "b.kvt"
    assert posix.publish(str(first), [memoryview(b"abc")], device=device) is True
    assert posix.publish(str(first), [memoryview(b"xyz")], device=device) is False
    assert posix.publish(str(second), [memoryview(b"def")], device=device) is True
    assert first.read_bytes() == b"abc" and second.read_bytes() == b"def"
    assert sorted(tmp_path.iterdir()) == [first, second]
    assert refused == [str(first)]  # refused once: that device links from then on


def test_rename_noreplace_never_replaces(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        rename_noreplace(str(src), str(dst))
    assert dst.read_bytes() == b"old" and src.exists()
    dst.unlink()
    rename_noreplace(str(src), str(dst))
    assert dst.read_bytes() == b"new" and not src.exists()
