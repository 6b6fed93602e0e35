"""The chaos fleet's L2 on failure paths, without engines (the replicas and the router are
stood in for): a start interrupted, or a stop whose first step fails, leaves no mount, no
FUSE daemon and no Valkey server behind."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from kvtier.tools.chaos import fleet as chaos_fleet
from kvtier.tools.chaos.fleet import ChaosFleet, FleetOptions, PhaseName
from kvtier.tools.l2ops.juicefs import mounted_under
from tests.helpers.faultfs import interrupt_the_first_mount_wait
from tests.helpers.l2 import needs_fuse
from tests.helpers.procs import running

pytestmark = needs_fuse


class Replicas:
    """Stands in for `LocalFleet`: starts nothing; its stop is interrupted (a second Ctrl-C
    during the replicas' drain)."""

    def __init__(self, *_args: object, **_kwargs: object) -> None:
        self.replicas: list[object] = []
        self.router = None

    def start(self) -> Replicas:
        return self

    def stop(self) -> None:
        raise KeyboardInterrupt


def children() -> list[int]:
    """This process's live descendants."""
    return [p.pid for p in psutil.Process().children(recursive=True) if running(p.pid)]


@pytest.mark.parametrize("phase", ["faultfs", "valkey"])
def test_a_stop_whose_fleet_step_fails_still_stops_the_l2(
    phase: PhaseName, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chaos_fleet, "LocalFleet", Replicas)
    before = set(children())
    fleet = ChaosFleet(phase, tmp_path / phase, FleetOptions()).start()
    assert set(children()) > before  # the L2's daemon or server
    try:
        with pytest.raises(KeyboardInterrupt):
            fleet.stop()
        assert not mounted_under(str(tmp_path)) and set(children()) <= before
    finally:
        fleet.fleet = None
        fleet.stop()


def test_a_start_interrupted_while_faultfs_mounts_leaves_no_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chaos_fleet, "LocalFleet", Replicas)
    daemons = interrupt_the_first_mount_wait(monkeypatch)  # while the fleet waits for it
    fleet = ChaosFleet("faultfs", tmp_path / "faultfs", FleetOptions())
    try:
        with pytest.raises(KeyboardInterrupt):
            fleet.start()
        assert daemons and not running(daemons[0])
        assert not mounted_under(str(tmp_path))
    finally:
        monkeypatch.undo()
        fleet.stop()


def test_a_new_run_starts_without_the_fault_an_interrupted_one_left_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Replicas, "stop", lambda _self: None)
    monkeypatch.setattr(chaos_fleet, "LocalFleet", Replicas)
    interrupted = ChaosFleet("faultfs", tmp_path, FleetOptions()).start()
    try:
        assert interrupted.faultfs is not None
        interrupted.faultfs.set_mode("eio")  # the l2-eio fault injected, never recovered
    finally:
        interrupted.stop()
    with ChaosFleet("faultfs", tmp_path, FleetOptions()).start() as fleet:
        assert fleet.l2_path is not None
        (Path(fleet.l2_path) / "block.kvt").write_bytes(b"block")
