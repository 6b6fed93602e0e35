"""faultfs, the chaos suite's fault-injecting FUSE passthrough, on a real mount."""

from __future__ import annotations

import errno
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.core.settings import StoreSettings
from kvtier.core.store import TieredStore
from kvtier.core.tiers import posix
from kvtier.core.tiers.noreplace import RENAME_NOREPLACE, rename_noreplace
from kvtier.tools.chaos.faultfs import FaultFS, _Control, _fuse_class, _operations
from kvtier.tools.l2ops.juicefs import fuse_available, mounted_under
from tests.helpers.faultfs import interrupt_the_first_mount_wait
from tests.helpers.l2 import IDENTITY, make_block, needs_fuse
from tests.helpers.procs import running


@pytest.fixture
def faultfs(tmp_path: Path) -> Iterator[FaultFS]:
    if not fuse_available():
        pytest.skip("FUSE mounts need root + /dev/fuse")
    backing = tmp_path / "backing"
    backing.mkdir()
    fs = FaultFS(str(backing), str(tmp_path / "mnt"), str(tmp_path / "faultfs.log"))
    fs.mount()
    try:
        yield fs
    finally:
        fs.unmount()


@pytest.fixture
def mount(faultfs: FaultFS) -> Path:
    return Path(faultfs.mountpoint)


def test_a_rename_asked_not_to_replace_never_replaces(mount: Path) -> None:
    """mfusepy drops rename's flags; faultfs passes them on, so L2 publish-if-absent holds."""
    block = mount / "blk.kvt"
    assert posix.publish(str(block), [memoryview(b"first")]) is True
    assert posix.publish(str(block), [memoryview(b"second")]) is False
    assert block.read_bytes() == b"first"
    assert [p.name for p in mount.iterdir()] == ["blk.kvt"]  # no temp file left
    other = mount / "other"
    other.write_bytes(b"other")
    with pytest.raises(FileExistsError):
        rename_noreplace(str(other), str(block))
    assert block.read_bytes() == b"first"
    other.replace(block)  # a plain rename still replaces
    assert block.read_bytes() == b"other"


def test_the_passthrough_keeps_rename_flags(tmp_path: Path) -> None:
    """On one mount the kernel refuses a no-replace rename onto a name it sees; between two
    nodes only the daemon can (the other node's file is not in this one's dentries). mfusepy's
    own FUSE drops the flags: faultfs's passes them to its operations, which honour them."""
    from mfusepy import FuseOSError

    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    ops = _operations(str(tmp_path), _Control(str(tmp_path / "control.json")))
    with pytest.raises(FuseOSError) as refused:
        ops.rename("/a", "/b", RENAME_NOREPLACE)
    assert refused.value.errno == errno.EEXIST and (tmp_path / "b").read_bytes() == b"b"
    with pytest.raises(FuseOSError):
        ops.rename("/a", "/b", 2)  # RENAME_EXCHANGE: not mirrored
    seen: list[tuple[str, str, int]] = []

    def rename(old: str, new: str, flags: int) -> int:
        seen.append((old, new, flags))
        return 0

    host = SimpleNamespace(
        operations=SimpleNamespace(rename=rename),
        encoding="utf-8",
        errors="strict",
    )
    assert _fuse_class().rename_fuse_3(host, b"/x", b"/y", RENAME_NOREPLACE) == 0
    assert seen == [("/x", "/y", RENAME_NOREPLACE)]


def test_closing_a_store_returns_within_its_timeout_while_its_l2_mount_hangs(
    faultfs: FaultFS,
) -> None:
    """The mount's FUSE daemon is stopped, so the janitor's next pass hangs in it: the store's
    close waits for that pass only until its timeout, as for its L2 writers (the connector
    closes its store so when vLLM stops)."""
    store = TieredStore(
        StoreSettings(
            l1_bytes=0,
            l2_path=faultfs.mountpoint,
            l2_capacity_bytes=10**8,
            l2_janitor_interval_s=0.05,
        ),
        IDENTITY,
    )
    for index in range(3):
        store.save(*make_block(1, index, 64 << 10))
    assert store.flush(10)
    assert faultfs.process is not None
    closed = threading.Event()

    def close() -> None:
        store.close(timeout_s=1)
        closed.set()

    closer = threading.Thread(target=close)
    faultfs.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)  # the janitor's next pass is in the frozen mount
        started = time.monotonic()
        closer.start()
        assert closed.wait(10), "close() waited for the hung mount"
        assert time.monotonic() - started < 5
    finally:
        faultfs.process.send_signal(signal.SIGCONT)
        closer.join(10)


@needs_fuse
def test_a_mount_interrupted_while_it_waits_leaves_no_mount_and_no_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = FaultFS(str(tmp_path), str(tmp_path / "mnt"), str(tmp_path / "faultfs.log"))
    daemons = interrupt_the_first_mount_wait(monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            fs.mount()
        time.sleep(1.0)  # long enough for a daemon left running to mount
        assert daemons and not running(daemons[0])
        assert not mounted_under(str(tmp_path))
    finally:
        fs.unmount()
