"""Cluster-wide L2 capacity on two JuiceFS mounts: writers, janitors, lease failover."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from kvtier.core.codec import HEADER_BYTES
from kvtier.core.tiers.janitor import Janitor, JanitorSettings, read_status
from kvtier.core.tiers.lease import FileLease, LeaseInfo
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.usage import control_dir, scan
from kvtier.tools.l2ops.juicefs import JuiceFSMount
from tests.helpers.l2 import (
    IDENTITY,
    NAMESPACE,
    finish_worker,
    make_block,
    needs_fuse,
    poll,
    spawn_worker,
)

pytestmark = [pytest.mark.juicefs, needs_fuse]

KIB = 1024
BLOCK = 256 * KIB
FILE = BLOCK + HEADER_BYTES
CAPACITY = 64 * FILE
HIGH, LOW = 0.8, 0.5
STALE_S = 1.5  # a block published through the other mount may be unseen this long


def janitor_args(path: str, holder: str, seconds: float) -> list[str]:
    return [
        "janitor",
        path,
        "--holder",
        holder,
        "--seconds",
        str(seconds),
        "--capacity",
        str(CAPACITY),
        "--high",
        str(HIGH),
        "--low",
        str(LOW),
        "--lease-ttl",
        "2",
        "--interval",
        "0.1",
        "--grace",
        "0.5",
    ]


def test_three_writers_stay_under_high_plus_in_flight_and_usage_falls_to_low(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount], tmp_path: Path
) -> None:
    """Bound checked per sample: usage <= high watermark + what the janitor could not have
    seen at its latest pass: blocks finished after that pass began, or, when written through
    the other mount, within the cross-mount staleness before it."""
    a, b = two_mounts
    mount_of = {"standby": a.path, "writer-0": a.path, "writer-1": b.path, "writer-2": a.path}
    standby = spawn_worker(*janitor_args(a.path, "standby", 120))
    writers = [
        spawn_worker(
            "fill",
            mount_of[f"writer-{w}"],
            "--writer",
            str(w),
            "--bytes",
            str(BLOCK),
            "--seconds",
            "6",
            "--rate",
            "10",
            "--log",
            str(tmp_path / f"w{w}.json"),
            "--capacity",
            str(CAPACITY),
            "--high",
            str(HIGH),
            "--low",
            str(LOW),
            "--lease-ttl",
            "2",
            "--interval",
            "0.1",
            "--grace",
            "0.5",
        )
        for w in range(3)
    ]
    samples: list[tuple[tuple[float, str], int]] = []
    seen: tuple[float, str] = (0.0, "standby")  # newest janitor pass seen: (start, holder)
    try:
        while any(w.poll() is None for w in writers) and len(samples) < 10_000:
            status = read_status(a.path)  # None while a rewrite is in progress
            if status is not None and float(status["started_at"]) > seen[0]:  # type: ignore[arg-type]
                seen = (float(status["started_at"]), str(status["holder"]))  # type: ignore[arg-type]
            samples.append((seen, scan(a.path, 600, time.time()).used_bytes))
            time.sleep(0.05)
        reports = [finish_worker(w) for w in writers]
        assert all(r["errors"] == 0 for r in reports)
        logs = {f"writer-{w}": json.loads((tmp_path / f"w{w}.json").read_text()) for w in range(3)}
        total = sum(size + HEADER_BYTES for log in logs.values() for _, _, size in log)
        assert total > 2 * CAPACITY  # the janitor had to evict to keep up
        high = int(CAPACITY * HIGH)
        for (since, holder), used in samples:
            in_flight = sum(
                size + HEADER_BYTES
                for writer, log in logs.items()
                for _, finished, size in log
                if finished >= since - (0 if mount_of[writer] == mount_of[holder] else STALE_S)
            )
            assert used <= high + in_flight, (used, high, in_flight)
        # Writers stopped: the standby janitor takes the lease and trims to the low watermark.
        low = int(CAPACITY * LOW)
        assert poll(lambda: scan(a.path, 600, time.time()).used_bytes <= low, deadline_s=30)
        assert poll(lambda: not scan(a.path, 600, time.time()).graveyard, deadline_s=30)
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
        standby.terminate()
        standby.wait(30)


def test_the_lease_moves_to_another_process_when_its_holder_is_killed(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    procs = {
        "x": spawn_worker(*janitor_args(a.path, "x", 120)),
        "y": spawn_worker(*janitor_args(b.path, "y", 120)),
    }
    observer = FileLease(control_dir(a.path, "lease"), "observer", ttl_s=2, stale_s=1)
    try:

        def holder_among(names: set[str]) -> LeaseInfo | None:
            info = observer.current()
            return info if info and not info.expired and info.holder in names else None

        first = poll(lambda: holder_among(set(procs)), deadline_s=30)
        assert first is not None
        procs[first.holder].send_signal(signal.SIGKILL)
        procs[first.holder].wait(30)
        other = "y" if first.holder == "x" else "x"
        second = poll(lambda: holder_among({other}), deadline_s=30)
        assert second is not None and second.epoch > first.epoch
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
            proc.wait(30)


def test_a_block_evicted_on_one_node_is_read_completely_by_a_reader_on_the_other(
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
) -> None:
    a, b = two_mounts
    writer = PosixTier(a.path, NAMESPACE, IDENTITY.manifest(), exists_ttl_s=0)
    h, meta, payload = make_block(30, 0, 4 * 1024 * KIB)
    assert writer.put(h, meta, payload).stored
    path_b = os.path.join(b.path, os.path.relpath(writer.path(h), a.path))
    assert poll(lambda: os.path.exists(path_b), deadline_s=10)
    fd = os.open(path_b, os.O_RDONLY)
    try:
        head = os.read(fd, HEADER_BYTES)
        # Node A's janitor evicts everything while node B is mid-read.
        janitor = Janitor(
            a.path,
            JanitorSettings(
                capacity_bytes=10 * FILE,
                low_watermark=0.01,
                high_watermark=0.02,
                interval_s=0.1,
                lease_ttl_s=2,
                grace_s=30,
            ),
        )
        # (An earlier test's janitor may hold the lease until its TTL runs out.)
        report = poll(lambda: janitor.run_once(force_low=True), deadline_s=15, interval_s=0.2)
        janitor.close()
        assert report is not None and report.evicted_blocks >= 1
        time.sleep(1.0)  # let the rename reach B's caches before reading on
        rest = b""
        while chunk := os.read(fd, 1 << 20):
            rest += chunk
    finally:
        os.close(fd)
    assert len(head) == HEADER_BYTES and rest == payload
    reader = PosixTier(b.path, NAMESPACE, IDENTITY.manifest(), exists_ttl_s=0)
    assert poll(lambda: reader.get(h) is None, deadline_s=10)  # new readers: a miss
    assert reader.stats().corrupt_removed == 0
