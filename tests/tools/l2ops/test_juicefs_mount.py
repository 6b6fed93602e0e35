"""A JuiceFS mount stopped by kvtier leaves nothing in /tmp, however its daemon ended: the
supervisor's `/tmp/fuse_fd_comm.<pid>` (a path fixed in JuiceFS) outlives a killed supervisor."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvtier.core.errors import TierError
from kvtier.tools.l2ops import juicefs
from kvtier.tools.l2ops.juicefs import (
    JuiceFSMount,
    JuiceFSVolume,
    JuiceFSVolumeSpec,
    fd_comm_socket,
)
from tests.helpers.l2 import needs_fuse
from tests.helpers.procs import running

pytestmark = [pytest.mark.juicefs, needs_fuse]


def kill_daemon(mount: JuiceFSMount) -> None:
    os.killpg(mount.process.pid, signal.SIGKILL)  # a crashed FUSE client, not yet reaped


def stall_supervisor(mount: JuiceFSMount) -> None:
    os.kill(mount.process.pid, signal.SIGSTOP)  # does not exit when unmounted: killed then


@pytest.mark.parametrize("before_unmount", [None, kill_daemon, stall_supervisor])
def test_an_unmounted_mount_leaves_no_socket_in_tmp(tmp_path: Path, before_unmount: object) -> None:
    with JuiceFSVolume(JuiceFSVolumeSpec(root=str(tmp_path))) as volume:
        mount = volume.mount()
        comm = Path(fd_comm_socket(mount.process.pid))
        assert comm.is_socket()
        if callable(before_unmount):
            before_unmount(mount)
        mount.unmount(timeout_s=2)
        volume.mounts.remove(mount)
        assert not mount.mounted()
    assert not comm.exists()


def test_a_killed_mount_leaves_no_socket_in_tmp(tmp_path: Path) -> None:
    with JuiceFSVolume(JuiceFSVolumeSpec(root=str(tmp_path))) as volume:
        mount = volume.mount()
        comm = Path(fd_comm_socket(mount.process.pid))
        mount.kill()
        assert mount.process.returncode == -signal.SIGKILL and not comm.exists()
        with pytest.raises(OSError):
            os.statvfs(mount.path)  # attached, dead, until unmounted
    assert not mount.mounted()


def test_a_close_whose_first_unmount_fails_still_unmounts_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = JuiceFSVolume(JuiceFSVolumeSpec(root=str(tmp_path)))
    older, newer = volume.mount(), volume.mount()
    try:
        monkeypatch.setattr(newer, "unmount", failing_unmount)
        with pytest.raises(KeyboardInterrupt):
            volume.close()  # newest first: its unmount is interrupted
        assert not older.mounted() and not running(older.process.pid)
    finally:
        monkeypatch.undo()
        for mount in (older, newer):
            mount.unmount()


def failing_unmount() -> None:
    raise KeyboardInterrupt  # a Ctrl-C while the mount is being unmounted


def test_force_unmount_without_a_juicefs_binary_detaches_with_the_generic_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `kvtier down` cleaning after a killed `kvtier up` from an environment without juicefs."""
    with JuiceFSVolume(JuiceFSVolumeSpec(root=str(tmp_path))) as volume:
        mount = volume.mount()

        def no_binary() -> str:
            raise TierError("no juicefs binary")

        monkeypatch.setattr(juicefs, "find_juicefs_binary", no_binary)
        assert juicefs.force_unmount(mount.path) and not mount.mounted()
        monkeypatch.undo()
