"""A short chaos run (`kvtier bench chaos --quick`): one fault of each kind on a 3-replica fleet
under load, with the acceptance targets of docs/reliability.md asserted per fault.

Kinds: a replica killed (SIGKILL) and one frozen past the health timeout (SIGSTOP), a replica's
engine frozen while its API server answers /health (a gray failure), the router killed, the
JuiceFS mount pulled, the JuiceFS metadata server killed, L2 blocks corrupted while read (on
JuiceFS); L2 reads failing with EIO, the L2 disk full, the L2 slow (faultfs over tmpfs). The
full list (replica restart, faultfs unmount, the Valkey L2 killed) and longer windows are the
documented `kvtier bench chaos` run (docs/reliability.md).

The targets asserted are behaviour: right answers, failover, error events, no loss, no leak,
and serving again after each fault. How fast serving is normal again (the 10 s target) is a
figure of the documented run, not asserted here: on 2 shared cores it is noise-bound.

About 9 minutes here (2 fleets of 3 engines); run it under the heavy lock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.tools.chaos.faults import FAULTS
from kvtier.tools.chaos.fleet import FleetOptions
from kvtier.tools.chaos.run import FaultResult, Timing, result_rows, run_phase

pytestmark = [pytest.mark.engine, pytest.mark.juicefs]

SHORT = {
    "juicefs": [
        "l2-corrupt",  # first: the faults after it check that no bad block was saved back
        "replica-sigkill",
        "replica-sigstop",
        "engine-sigstop",
        "router-kill",
        "l2-unmount",
        "juicefs-meta-kill",
    ],
    "faultfs": ["l2-eio", "l2-full", "l2-slow"],
}


def check_targets(r: FaultResult) -> None:
    assert r.wrong_outputs == 0, r
    assert r.hangs == 0, r
    if r.fault != "router-kill":  # a dead router cannot send an error event: the socket drops
        assert r.streams_cut_without_error == 0, r
    assert r.ok_after_end > 0, r  # served again after the fault
    answered = [t for t in r.timeline if t[2] == "ok"]
    assert all(t[4] is not None for t in answered), r  # each says what it took from a cache
    assert r.l2_lost_beyond_failed_part == 0, r
    assert r.leaked_processes == [] and r.leaked_mounts == [], r
    if r.fault != "router-kill":  # with the router down, clients cannot even connect
        plain = {k: n for k, n in r.failed.items() if k.startswith("plain")}
        assert plain == {}, r  # failover: no non-streaming request fails
        assert all("stream_error_event" in k for k in r.failed), r  # cut streams say so
    if r.fault in ("l2-unmount",):
        assert r.notes.get("files_on_bare_dir") == 0, r
    if r.fault == "router-kill":  # the replicas' snapshots refill it, new stores or none
        assert "index_rebuilt_s" in r.notes, r
    if r.fault == "engine-sigstop":  # seen stalled (/health stayed green), its requests moved
        assert float(str(r.notes.get("stalls", 0))) >= 1, r


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")
@pytest.mark.parametrize("phase", list(SHORT))
def test_one_fault_of_each_kind_meets_the_targets(phase: str, tmp_path: Path) -> None:
    faults = [FAULTS[name] for name in SHORT[phase]]
    results, info = run_phase(phase, faults, tmp_path, FleetOptions(), Timing(5.0, 10.0))  # type: ignore[arg-type]
    print(result_rows(results))
    print(info)
    for r in results:
        check_targets(r)
    assert info["leaked_processes_after_stop"] == [] and info["leaked_mounts_after_stop"] == []
