"""The L2 janitor on a local directory: watermarks, LRU by shared access, lease, graveyard."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.tiers.janitor import AccessRecorder, Janitor, JanitorSettings, read_status
from kvtier.core.tiers.lease import LEASE_MAX_BYTES, FileLease, LeaseInfo
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.usage import MAX_DEPTH, Entry, Usage, control_dir, plan_eviction, scan
from tests.helpers.l2 import IDENTITY, NAMESPACE, make_block, refuse

KIB = 1024


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fill(root: Path, count: int, nbytes: int, *, seed: int = 1) -> list[str]:
    """`count` blocks whose mtimes are 100 s, 99 s, ... ago (oldest first); their paths."""
    tier = PosixTier(str(root), NAMESPACE, IDENTITY.manifest())
    paths = []
    now = os.stat(root).st_mtime
    for i in range(count):
        h, meta, payload = make_block(seed, i, nbytes)
        tier.put(h, meta, payload)
        path = tier.path(h)
        os.utime(path, (now - 100 + i, now - 100 + i))
        paths.append(path)
    return paths


def config(**kw: object) -> JanitorSettings:
    base: dict[str, object] = {
        "capacity_bytes": 10 * (4096 + 100 * KIB),
        "high_watermark": 0.8,
        "low_watermark": 0.5,
        "interval_s": 0.1,
        "lease_ttl_s": 1.0,
        "grace_s": 0.0,
        "stale_s": 0.0,
    }
    base.update(kw)
    return JanitorSettings(**base)


def test_plan_evicts_least_recently_used_down_to_the_low_watermark() -> None:
    blocks = tuple(Entry(f"b{i}", 10, mtime) for i, mtime in enumerate([5, 1, 4, 2, 3]))
    usage = Usage(blocks, temp_bytes=0, orphans=(), graveyard=())
    cfg = JanitorSettings(capacity_bytes=50, high_watermark=0.9, low_watermark=0.5)
    # 50 bytes > high (45): evict oldest-access first until <= low (25).
    assert [e.path for e in plan_eviction(usage, cfg, trim=False)] == ["b1", "b3", "b4"]
    below_high = Usage(blocks[:4], temp_bytes=0, orphans=(), graveyard=())
    assert plan_eviction(below_high, cfg, trim=False) == []
    assert [e.path for e in plan_eviction(below_high, cfg, trim=True)] == ["b1", "b3"]


def test_in_flight_temp_files_count_towards_usage() -> None:
    blocks = (Entry("old", 10, 1), Entry("new", 10, 2))
    cfg = JanitorSettings(capacity_bytes=40, high_watermark=0.75, low_watermark=0.5)
    assert plan_eviction(Usage(blocks, 0, (), ()), cfg, trim=False) == []
    assert [e.path for e in plan_eviction(Usage(blocks, 15, (), ()), cfg, trim=False)] == [
        "old",
        "new",
    ]


def test_a_pass_above_high_evicts_the_oldest_blocks_and_reports_it(tmp_path: Path) -> None:
    paths = fill(tmp_path, 10, 100 * KIB)
    janitor = Janitor(str(tmp_path), config(capacity_bytes=9 * (4096 + 100 * KIB)))
    report = janitor.run_once()
    assert report is not None and report.trigger == "high"
    # 10 blocks in 9 slots: high is 7.2 slots, low 4.5 slots -> keep the newest 4.
    assert [os.path.exists(p) for p in paths] == [False] * 6 + [True] * 4
    assert (report.evicted_blocks, report.blocks_after) == (6, 4)
    assert read_status(str(tmp_path))["evicted_blocks"] == 6  # type: ignore[index]


def test_a_status_read_that_races_a_rewrite_reads_it_again(tmp_path: Path) -> None:
    Janitor(str(tmp_path), config(capacity_bytes=1024 * KIB)).run_once()
    status = control_dir(str(tmp_path), "status.json")
    whole = Path(status).read_bytes()
    Path(status).write_bytes(whole[: len(whole) // 2])  # a reader caught mid-rewrite
    pauses: list[float] = []

    def rewrite_done(seconds: float) -> None:
        pauses.append(seconds)
        Path(status).write_bytes(whole)

    assert read_status(str(tmp_path), pause=rewrite_done) == json.loads(whole)
    assert len(pauses) == 1
    Path(status).write_bytes(whole[:10])  # never completed: no report, no endless retry
    assert read_status(str(tmp_path), pause=lambda _: None) is None


def test_a_read_hit_recorded_by_any_replica_protects_the_block(tmp_path: Path) -> None:
    paths = fill(tmp_path, 10, 100 * KIB)
    recorder = AccessRecorder(touch_interval_s=60.0)
    fd = os.open(paths[0], os.O_RDONLY)  # the oldest block is read by some replica now
    try:
        assert recorder.record(fd, os.fstat(fd).st_mtime)
        assert not recorder.record(fd, os.fstat(fd).st_mtime)  # throttled: fresh already
    finally:
        os.close(fd)
    Janitor(str(tmp_path), config(capacity_bytes=9 * (4096 + 100 * KIB))).run_once()
    assert [os.path.exists(p) for p in paths] == [True] + [False] * 6 + [True] * 3


def test_an_idle_l2_is_trimmed_to_the_low_watermark(tmp_path: Path) -> None:
    paths = fill(tmp_path, 6, 100 * KIB)  # 6 of 10 slots: above low (5), below high (8)
    janitor = Janitor(str(tmp_path), config())
    first = janitor.run_once()
    assert first is not None and first.trigger is None  # no baseline yet: nothing to trim
    second = janitor.run_once()  # nothing new since the first pass: idle
    assert second is not None and second.trigger == "idle"
    assert [os.path.exists(p) for p in paths] == [False, True, True, True, True, True]


def test_only_one_janitor_acts_and_a_dead_holders_lease_is_taken_over(tmp_path: Path) -> None:
    clock = Clock()
    a = FileLease(str(tmp_path / "lease"), "a", ttl_s=10, stale_s=1, clock=clock)
    b = FileLease(str(tmp_path / "lease"), "b", ttl_s=10, stale_s=1, clock=clock)
    clock.now = os.stat(tmp_path).st_mtime
    assert a.try_acquire() and not b.try_acquire()
    assert b.current() is not None and b.current().holder == "a"
    clock.now += 5
    assert not b.try_acquire()  # a's heartbeat is 5 s old: still alive
    clock.now += 7  # 12 s without renewal > ttl + stale: a is presumed dead
    assert b.try_acquire() and b.epoch == 2
    assert not a.held()  # a, if it wakes up, sees it lost the lease
    b.release()
    assert a.try_acquire() and a.epoch == 3  # released: no need to wait for the TTL


@pytest.mark.parametrize(
    "body",
    [b"", b"{trunc", b"[]", b'"x"', b'{"ttl_s": "10"}', b'{"ttl_s": NaN}', b'{"ttl_s": 1e999}'],
)
def test_a_newest_lease_that_is_not_a_lease_is_expired_and_the_next_epoch_is_taken(
    tmp_path: Path, body: bytes
) -> None:
    lease_dir = tmp_path / "lease"
    lease_dir.mkdir()
    (lease_dir / "lease.000000000003").write_text('{"holder": "dead", "ttl_s": 1}')
    os.utime(lease_dir / "lease.000000000003", (0, 0))  # long expired
    (lease_dir / "lease.000000000004").write_bytes(body)  # junk, or empty after a crash
    a = FileLease(str(lease_dir), "a", ttl_s=10, stale_s=0)
    b = FileLease(str(lease_dir), "b", ttl_s=10, stale_s=0)
    assert a.try_acquire() and a.epoch == 5 and not b.try_acquire()
    (lease_dir / "lease.000000000006").write_bytes(body)
    assert b.try_acquire() and b.epoch == 7 and not a.try_acquire()


def _refuse(err: int) -> Callable[..., object]:
    def refused(*args: object, **kwargs: object) -> object:
        raise OSError(err, os.strerror(err))

    return refused


@pytest.mark.parametrize(
    ("call", "err"),
    [("write", errno.ENOSPC), ("link", errno.EPERM)],
    ids=["full-volume", "no-hard-links"],
)
def test_a_take_the_file_system_refuses_leaves_no_file_and_says_why_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    call: str,
    err: int,
) -> None:
    """A full volume (the lease's temp file gets no data) or one without hard links: every
    attempt fails, none leaves its temp file behind, and the reason is logged once; once the
    file system allows it, the lease is taken."""
    lease = FileLease(str(tmp_path), "a", ttl_s=10, stale_s=0)
    with monkeypatch.context() as patched:
        patched.setattr(os, call, _refuse(err))
        assert not any(lease.try_acquire() for _ in range(5))
    assert os.listdir(tmp_path) == []
    assert caplog.text.count("cannot take the lease") == 1 and os.strerror(err) in caplog.text
    assert lease.try_acquire() and os.listdir(tmp_path) == ["lease.000000000001"]


def test_a_directory_the_scan_cannot_read_is_named_and_the_janitor_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths = fill(tmp_path, 10, 100 * KIB)
    unreadable = os.path.dirname(paths[0])
    refuse(monkeypatch, os, "scandir", unreadable)
    (tmp_path / ("0" * 32)).mkdir()
    refuse(monkeypatch, os, "scandir", str(tmp_path / ("0" * 32)), errno.ENOENT)  # vanished
    usage = scan(str(tmp_path), float("inf"), 0.0)
    assert usage.unreadable == ((unreadable, "Permission denied"),)
    assert paths[0] not in [e.path for e in usage.blocks] and len(usage.blocks) > 0
    janitor = Janitor(str(tmp_path), config(capacity_bytes=9 * (4096 + 100 * KIB)))
    assert janitor.run_once() is not None and janitor.run_once() is not None
    assert caplog.text.count(f"cannot read {unreadable} (Permission denied)") == 1


def _plant_outside(directory: Path) -> list[str]:
    """Old `*.kvt`/`*.tmp` files outside L2 (janitor bait); their names."""
    directory.mkdir()
    for name in ("1.ab.notes.kvt", "upload.part.tmp"):
        (directory / name).write_bytes(b"x" * 300 * KIB)
        os.utime(directory / name, (0, 0))
    return sorted(os.listdir(directory))


def test_the_janitor_follows_no_symlink_out_of_l2(tmp_path: Path) -> None:
    root, outside = tmp_path / "l2", tmp_path / "outside"
    root.mkdir()
    bait = _plant_outside(outside)
    paths = fill(root, 10, 100 * KIB)
    (root / "abcdef").symlink_to(outside)  # named like a namespace
    (root / NAMESPACE / "ee").symlink_to(outside)  # a fan-out directory
    Path(paths[0]).with_name("f" * 32 + ".kvt").symlink_to(outside / bait[0])
    report = Janitor(str(root), config(capacity_bytes=9 * (4096 + 100 * KIB))).run_once()
    assert sorted(os.listdir(outside)) == bait
    assert report is not None and report.used_bytes_before == 10 * (4096 + 100 * KIB)
    assert (report.evicted_blocks, report.orphans_removed) == (6, 0)


def test_the_janitor_evicts_and_purges_nothing_through_a_symlinked_graveyard(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "l2", tmp_path / "outside"
    root.mkdir()
    bait = _plant_outside(outside)
    paths = fill(root, 10, 100 * KIB)
    os.symlink(outside, control_dir(str(root), "graveyard"))
    janitor = Janitor(str(root), config(capacity_bytes=9 * (4096 + 100 * KIB), grace_s=30))
    report = janitor.run_once()
    assert sorted(os.listdir(outside)) == bait
    assert report is not None and (report.evicted_blocks, report.purged_bytes) == (0, 0)
    assert all(os.path.exists(p) for p in paths)


@pytest.mark.parametrize("planted", [".kvtier", ".kvtier/lease"])
def test_no_lease_is_taken_through_a_symlinked_control_directory(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "l2", tmp_path / "outside"
    root.mkdir()
    paths = fill(root, 10, 100 * KIB)
    outside.mkdir()
    if planted == ".kvtier":
        (root / ".kvtier").rename(outside)
    (root / planted).symlink_to(outside)
    before = sorted(os.listdir(outside))
    janitor = Janitor(str(root), config(capacity_bytes=9 * (4096 + 100 * KIB)))
    assert janitor.run_once() is None  # not held: the janitor does not run
    assert not janitor.lease.held() and janitor.lease.current() is None
    assert sorted(os.listdir(outside)) == before
    assert all(os.path.exists(p) for p in paths)
    assert "not a directory of its own" in caplog.text


def test_evicted_blocks_stay_readable_for_open_readers_during_the_grace(tmp_path: Path) -> None:
    paths = fill(tmp_path, 10, 100 * KIB)
    fd = os.open(paths[1], os.O_RDONLY)  # a reader opened it just before the eviction
    try:
        Janitor(
            str(tmp_path), config(capacity_bytes=9 * (4096 + 100 * KIB), grace_s=3600)
        ).run_once()
        assert not os.path.exists(paths[1])  # new readers miss
        assert len(os.read(fd, 1 << 20)) == 4096 + 100 * KIB  # this one completes
    finally:
        os.close(fd)
    grave = os.listdir(control_dir(str(tmp_path), "graveyard"))
    assert len(grave) == 6
    usage = scan(str(tmp_path), 600, 0)
    assert len(usage.graveyard) == 6 and len(usage.blocks) == 4


def test_graveyard_is_purged_after_the_grace_and_orphan_temps_are_removed(tmp_path: Path) -> None:
    clock = Clock()
    fill(tmp_path, 10, 100 * KIB)
    orphan = tmp_path / NAMESPACE / "ab" / "cd"
    orphan.mkdir(parents=True)
    (orphan / "x.kvt.dead.tmp").write_bytes(b"partial")
    os.utime(orphan / "x.kvt.dead.tmp", (0, 0))
    clock.now = os.stat(tmp_path).st_mtime
    janitor = Janitor(
        str(tmp_path),
        config(capacity_bytes=9 * (4096 + 100 * KIB), grace_s=30, lease_ttl_s=100),
        clock=clock,
    )
    first = janitor.run_once()
    assert first is not None and first.orphans_removed == 1 and first.purged_bytes == 0
    assert not (orphan / "x.kvt.dead.tmp").exists()
    for entry in os.scandir(control_dir(str(tmp_path), "graveyard")):  # renamed 31 s ago
        stamp, rest = entry.name.split(".", 1)
        os.rename(
            entry.path,
            os.path.join(os.path.dirname(entry.path), f"{int(stamp) - 31 * 10**9}.{rest}"),
        )
    second = janitor.run_once()
    assert second is not None and second.purged_bytes == 6 * (4096 + 100 * KIB)
    assert os.listdir(control_dir(str(tmp_path), "graveyard")) == []


def test_janitor_config_names_the_bad_field() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        JanitorSettings(capacity_bytes=10, high_watermark=0.5, low_watermark=0.7)
    with pytest.raises(ValueError, match="lease_ttl_s"):
        JanitorSettings(capacity_bytes=10, interval_s=5, lease_ttl_s=6)


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    ("swapped", "grace_s"),
    [(NAMESPACE, 0.0), (NAMESPACE, 30.0), (".kvtier/graveyard", 30.0)],
    ids=["namespace-unlink", "namespace-graveyard", "graveyard-purge"],
)
def test_a_directory_swapped_for_a_symlink_after_the_scan_leads_no_removal_out_of_l2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str, grace_s: float
) -> None:
    """Between the scan and the removals someone who can write the root replaces a directory
    by a symlink to a copy elsewhere (same names: files the janitor would then reach): no
    eviction, orphan removal or purge touches the copy."""
    root, outside = tmp_path / "l2", tmp_path / "outside"
    root.mkdir()
    fill(root, 10, 100 * KIB)
    orphan = root / NAMESPACE / "ab" / "cd" / "x.kvt.dead.tmp"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"partial")
    os.utime(orphan, (0, 0))
    cfg = config(capacity_bytes=9 * (4096 + 100 * KIB), grace_s=grace_s, lease_ttl_s=100)
    janitor = Janitor(str(root), cfg)
    if swapped != NAMESPACE:  # fill the graveyard with entries past their grace
        assert janitor.run_once() is not None
        for entry in os.scandir(control_dir(str(root), "graveyard")):
            stamp, rest = entry.name.split(".", 1)
            os.rename(entry.path, Path(entry.path).with_name(f"{int(stamp) - 31 * 10**9}.{rest}"))
    real_scan = scan

    def scan_then_swap(*args: Any, **kwargs: Any) -> Usage:
        usage = real_scan(*args, **kwargs)
        (root / swapped).rename(tmp_path / "moved")
        (root / swapped).symlink_to(outside)
        return usage

    shutil.copytree(root / swapped, outside)
    before = _tree(outside)
    assert before  # the bait: blocks, an orphan, or graveyard entries
    monkeypatch.setattr("kvtier.core.tiers.janitor.scan", scan_then_swap)
    report = janitor.run_once()
    assert report is not None
    assert _tree(outside) == before


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_planted_status_file_is_neither_written_through_nor_waited_on(
    tmp_path: Path, planted: str
) -> None:
    """`.kvtier/status.json` replaced by a symlink to a file outside L2, or by a FIFO: a pass
    writes nothing outside and does not block, and `read_status` reads no report."""
    root, outside = tmp_path / "l2", tmp_path / "precious"
    root.mkdir()
    outside.write_text('{"mine": 1}')
    janitor = Janitor(str(root), config())
    status = control_dir(str(root), "status.json")
    if planted == "symlink":
        os.symlink(outside, status)
    else:
        os.mkfifo(status)
    results: list[object] = []

    def work() -> None:
        results.append(janitor.run_once())
        results.append(read_status(str(root), pause=lambda _: None))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(10.0)
    if thread.is_alive():  # blocked in open(): give it the other end so that it ends
        for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
            with contextlib.suppress(OSError):
                os.close(os.open(status, flags))
        thread.join(10.0)
        pytest.fail("a pass or status read blocked on the planted status file")
    assert results[0] is not None and results[1] is None
    assert outside.read_text() == '{"mine": 1}'


def test_a_planted_deep_tree_neither_stops_the_janitor_nor_is_walked(tmp_path: Path) -> None:
    """1,200 nested directories in a namespace (deeper than Python's recursion limit): the scan
    names the first level past `MAX_DEPTH` as unreadable and the pass evicts as usual."""
    paths = fill(tmp_path, 10, 100 * KIB)
    levels = 1200
    top = tmp_path / NAMESPACE
    fd = os.open(tmp_path / NAMESPACE, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    try:
        usage = scan(str(tmp_path), 600, 0)
        too_deep = os.path.join(top, *["d"] * (MAX_DEPTH + 1))
        assert usage.unreadable == ((too_deep, f"nested deeper than {MAX_DEPTH} levels"),)
        report = Janitor(str(tmp_path), config(capacity_bytes=9 * (4096 + 100 * KIB))).run_once()
        assert report is not None and report.evicted_blocks == 6
        assert [os.path.exists(p) for p in paths] == [False] * 6 + [True] * 4
    finally:
        for depth in range(levels, 0, -1):  # rmtree recurses as deep as the tree
            os.rmdir(os.path.join(tmp_path / NAMESPACE, *["d"] * depth))


@pytest.mark.parametrize("planted", ["symlink", "fifo", "oversized", "directory"])
def test_a_planted_lease_file_is_no_lease_and_is_neither_followed_nor_waited_on(
    tmp_path: Path, planted: str
) -> None:
    """The newest lease file replaced by a symlink to a fresh lease elsewhere, a FIFO, a
    lease padded past `LEASE_MAX_BYTES`, or a directory: it is no lease (expired), so the next
    epoch is taken at once, without blocking, reading it whole, or touching what a symlink
    leads to."""
    lease_dir, outside = tmp_path / "lease", tmp_path / "outside"
    lease_dir.mkdir()
    outside.write_text('{"holder": "outside", "ttl_s": 3600}')  # fresh: "held" if followed
    os.utime(outside, (0, time.time()))
    (lease_dir / "lease.000000000003").write_text('{"holder": "dead", "ttl_s": 1}')
    os.utime(lease_dir / "lease.000000000003", (0, 0))  # long expired
    newest = lease_dir / "lease.000000000004"
    if planted == "symlink":
        newest.symlink_to(outside)
    elif planted == "fifo":
        os.mkfifo(newest)
    elif planted == "directory":
        newest.mkdir()
    else:
        newest.write_text('{"holder": "big", "ttl_s": 3600}' + " " * LEASE_MAX_BYTES)
    lease = FileLease(str(lease_dir), "a", ttl_s=10, stale_s=0)
    taken: list[bool] = []
    thread = threading.Thread(target=lambda: taken.append(lease.try_acquire()), daemon=True)
    thread.start()
    thread.join(10.0)
    if thread.is_alive():  # blocked in open(): give it a writer so that it ends
        with contextlib.suppress(OSError):
            os.close(os.open(newest, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10.0)
        pytest.fail("taking the lease blocked on a planted FIFO")
    assert taken == [True] and lease.epoch == 5
    if planted == "symlink":  # a holder whose own file became a symlink renews no target
        os.unlink(lease_dir / "lease.000000000005")
        os.symlink(outside, lease_dir / "lease.000000000005")
        os.utime(outside, (0, 1))
        lease.try_acquire()
        assert os.stat(outside).st_mtime == 1
        lease.release()
        assert os.stat(outside).st_mtime == 1


def test_a_contender_that_stalled_takes_no_epoch_behind_a_newer_holder(tmp_path: Path) -> None:
    """c sees a's lease expired, then stalls while b takes epoch 2 and releases it and d takes
    epoch 3 (removing 1 and 2): the name epoch 2 is free again, but c must not hold it."""
    clock = Clock(os.stat(tmp_path).st_mtime)
    a, b, c, d = (
        FileLease(str(tmp_path), name, ttl_s=10, stale_s=1, clock=clock) for name in "abcd"
    )
    assert a.try_acquire() and a.epoch == 1
    clock.now += 12  # a is presumed dead
    look = c.current

    def stalled_look() -> LeaseInfo | None:
        latest = look()
        assert b.try_acquire() and b.epoch == 2
        b.release()
        assert d.try_acquire() and d.epoch == 3
        return latest

    c.current = stalled_look  # type: ignore[method-assign]
    assert not c.try_acquire() and c.epoch is None
    assert sorted(os.listdir(tmp_path)) == ["lease.000000000003"] and d.held()


def test_writes_and_reuse_are_not_mistaken_for_idle_when_the_janitors_clock_runs_ahead(
    tmp_path: Path,
) -> None:
    """The janitor's node is 60 s ahead of the writers' (more than a pass apart): a block
    written or re-used since the previous pass still has an mtime before that pass began on
    the janitor's clock, yet it is activity: no idle trim until a pass sees nothing change."""
    paths = fill(tmp_path, 6, 100 * KIB)  # 6 of 10 slots: above low (5), below high (8)
    clock = Clock(time.time() + 60)
    janitor = Janitor(str(tmp_path), config(lease_ttl_s=1000), clock=clock)
    assert janitor.run_once() is not None  # the baseline
    (new,) = fill(tmp_path, 1, 100 * KIB, seed=2)
    os.utime(new)  # written now, on the writer's clock
    clock.now += 5
    written = janitor.run_once()
    assert written is not None and written.trigger is None
    os.utime(paths[0])  # the oldest block re-used now
    clock.now += 5
    reused = janitor.run_once()
    assert reused is not None and reused.trigger is None
    clock.now += 5
    idle = janitor.run_once()
    assert idle is not None and idle.trigger == "idle"
    assert [os.path.exists(p) for p in [*paths, new]] == [
        True,
        False,
        False,
        True,
        True,
        True,
        True,
    ]


def test_a_scan_longer_than_the_lease_keeps_it_and_no_other_janitor_acts_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow file system (0.1 s per directory listed): a's scan lasts about 2 s, twice its
    lease TTL, while b tries to take the lease throughout; a renews it as it scans, so b never
    holds it and a's pass evicts."""
    fill(tmp_path, 10, 100 * KIB)
    cfg = config(capacity_bytes=9 * (4096 + 100 * KIB), interval_s=0.1, lease_ttl_s=1.0)
    a, b = Janitor(str(tmp_path), cfg, holder="a"), Janitor(str(tmp_path), cfg, holder="b")
    assert a.lease.try_acquire()
    real_scandir = os.scandir
    b_held: list[bool] = []

    def slow_scandir(path: Any) -> Any:
        time.sleep(0.1)
        b_held.append(b.lease.try_acquire())
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", slow_scandir)
    started = time.monotonic()
    report = a.run_once()
    assert time.monotonic() - started > 2 * cfg.lease_ttl_s  # the scan outlasted the lease
    assert not any(b_held) and len(b_held) > 20
    assert report is not None and report.evicted_blocks == 6


def test_a_janitor_that_loses_the_lease_during_its_scan_evicts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a stalls 1.2 s in its first listing (past its 1 s TTL) and b takes the lease: a's scan
    ends at its next renewal and its pass does nothing; b's evicts."""
    paths = fill(tmp_path, 10, 100 * KIB)
    cfg = config(capacity_bytes=9 * (4096 + 100 * KIB), interval_s=0.1, lease_ttl_s=1.0)
    a, b = Janitor(str(tmp_path), cfg, holder="a"), Janitor(str(tmp_path), cfg, holder="b")
    real_scandir = os.scandir
    stalls = [1.2]

    def stalling_scandir(path: Any) -> Any:
        if stalls:
            time.sleep(stalls.pop())
            assert b.lease.try_acquire()
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", stalling_scandir)
    assert a.run_once() is None
    assert all(os.path.exists(p) for p in paths)
    report = b.run_once()
    assert report is not None and report.evicted_blocks == 6
