"""An L2 mount that vanishes under a replica is noticed: misses, a warning, counted errors,
nothing written to the bare mountpoint, and L2 back by itself when the volume returns.

Real mounts: a bind mount of a backing directory (detached with `umount -l`, bound again), and
a JuiceFS FUSE mount (detached with `fusermount3 -u -z`, mounted again)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.core.tiers.posix import VOLUME_CHECK_S, PosixTier
from kvtier.core.tiers.usage import control_dir
from tests.helpers.tiers import NAMESPACE, hash_of, meta_for, payload_for

MANIFEST = {"namespace": NAMESPACE}
NBYTES = 32 * 1024

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


def put(tier: PosixTier, name: str) -> bool:
    h = hash_of(name)
    return tier.put(h, meta_for(NBYTES), payload_for(h, NBYTES)).stored


def got(tier: PosixTier, name: str) -> bool:
    block = tier.get(hash_of(name))
    return block is not None and bytes(block.payload) == payload_for(hash_of(name), NBYTES)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def mounted(path: Path) -> bool:
    return os.path.ismount(path)


def check_outage_and_return(
    tier: PosixTier,
    mountpoint: Path,
    detach: Callable[[], None],
    attach: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert put(tier, "before") and got(tier, "before")
    errors_before = tier.stats().errors
    detach()
    assert not mounted(mountpoint)
    # writes and reads for a while, including the first second in which the cached check
    # still says "usable": nothing may land on the bare directory
    deadline = time.monotonic() + 2.5 * VOLUME_CHECK_S
    i = 0
    while time.monotonic() < deadline:
        assert not put(tier, f"during-{i}")
        assert not got(tier, "before")
        assert not tier.contains(hash_of("before"))
        i += 1
        time.sleep(0.05)
    assert tree(mountpoint) == [], "the tier wrote to the bare mountpoint"
    assert not tier.usable
    assert tier.stats().errors > errors_before
    assert any("no longer the shared volume" in r.getMessage() for r in caplog.records)
    attach()
    assert wait_until(lambda: got(tier, "before")), "L2 did not resume"
    assert tier.usable and put(tier, "after") and got(tier, "after")
    assert any("is back" in r.getMessage() for r in caplog.records)


def test_a_detached_bind_mount_is_noticed_and_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.core.tiers.posix")
    backing, mountpoint = tmp_path / "backing", tmp_path / "l2"
    backing.mkdir()
    mountpoint.mkdir()
    # a file system of its own (as a FUSE mount is), bound onto the mountpoint
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(backing)], check=True)

    def attach() -> None:
        subprocess.run(["mount", "--bind", str(backing), str(mountpoint)], check=True)

    def detach() -> None:
        subprocess.run(["umount", "-l", str(mountpoint)], check=True)

    attach()
    try:
        tier = PosixTier(str(mountpoint), NAMESPACE, MANIFEST, exists_ttl_s=0)
        check_outage_and_return(tier, mountpoint, detach, attach, caplog)
        assert (backing / NAMESPACE).is_dir()
    finally:
        for path in (mountpoint, backing):
            while mounted(path):
                subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_replaced_directory_is_not_taken_for_the_volume(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    root.mkdir()
    tier = PosixTier(str(root), NAMESPACE, MANIFEST, exists_ttl_s=0)
    assert put(tier, "a")
    root.rename(tmp_path / "moved")  # the volume moves away, another directory takes its path
    root.mkdir()
    assert wait_until(lambda: not tier.usable, 3 * VOLUME_CHECK_S)
    assert not put(tier, "b") and tree(root) == []


def test_files_are_0600_and_directories_0700_by_default(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tier = PosixTier(str(tmp_path), NAMESPACE, MANIFEST, exists_ttl_s=0)
        assert put(tier, "a")
    finally:
        os.umask(old)
    block = Path(tier.path(hash_of("a")))
    assert block.stat().st_mode & 0o777 == 0o600
    for directory in (block.parent, block.parent.parent, tmp_path / NAMESPACE):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert (tmp_path / NAMESPACE / "manifest.json").stat().st_mode & 0o777 == 0o600
    assert Path(control_dir(str(tmp_path), "volume.json")).is_file()


@pytest.mark.parametrize("namespace", ["../etc", "AB12", "0123/4567", "", "x" * 10])
def test_block_paths_come_only_from_hex_digests(tmp_path: Path, namespace: str) -> None:
    from kvtier.core.errors import TierError
    from kvtier.core.keys import Namespace

    with pytest.raises(TierError, match="not a hex digest"):
        PosixTier(str(tmp_path), Namespace(namespace), MANIFEST)
    tier = PosixTier(str(tmp_path), NAMESPACE, MANIFEST)
    h = hash_of("x")
    assert tier.path(h) == str(tmp_path / NAMESPACE / h.hex()[:2] / h.hex()[2:4] / f"{h.hex()}.kvt")


@pytest.fixture
def juicefs_volume(tmp_path: Path) -> Iterator[object]:
    from kvtier.tools.l2ops.juicefs import JuiceFSVolume, JuiceFSVolumeSpec, fuse_available

    if not fuse_available():
        pytest.skip("FUSE mounts need root + /dev/fuse")
    volume = JuiceFSVolume(JuiceFSVolumeSpec(root=str(tmp_path / "jfs")))
    try:
        yield volume
    finally:
        volume.close()


@pytest.mark.juicefs
def test_a_juicefs_mount_detached_under_the_tier_is_noticed_and_resumed(
    juicefs_volume, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.core.tiers.posix")
    mount = juicefs_volume.mount()
    mountpoint = Path(mount.path)
    tier = PosixTier(mount.path, NAMESPACE, MANIFEST, exists_ttl_s=0)

    def detach() -> None:
        subprocess.run(["fusermount3", "-u", "-z", mount.path], check=True)

    def attach() -> None:
        juicefs_volume.mount(mount.path)

    check_outage_and_return(tier, mountpoint, detach, attach, caplog)
