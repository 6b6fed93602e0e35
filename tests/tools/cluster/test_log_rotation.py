"""`kvtier up` bounds its logs: a log past the bound is copied to `<name>.1` and emptied in
place while the server writing it goes on writing (a real process, appending as the fleet's
servers do); bound 0 never rotates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

from kvtier.tools.cluster.log_rotation import LogRotator
from tests.helpers.l2 import poll

BOUND = 4096
INTERVAL_S = 0.05
WAIT_S = 30.0

# appends numbered lines to its stdout, one write each, a line a millisecond
_WRITER = """
import itertools, time
for i in itertools.count():
    print(i, flush=True)
    time.sleep(0.001)
"""


@contextmanager
def writing_server(log: Path) -> Iterator[None]:
    """A process appending numbered lines to `log` through a descriptor opened "ab", as the
    fleet's servers' logs are opened; killed at the end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", _WRITER], stdout=out)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def numbers(path: Path) -> list[int]:
    """The numbered lines of `path`, checked to follow each other without a gap."""
    data = path.read_bytes()
    assert b"\0" not in data  # (no hole: the writes went on at the start of the emptied file)
    found = [int(line) for line in data.split()]
    assert all(b == a + 1 for a, b in pairwise(found))
    return found


@contextmanager
def rotating(work_dir: Path, max_bytes: int) -> Iterator[None]:
    rotator = LogRotator(work_dir, max_bytes, interval_s=INTERVAL_S)
    rotator.start()
    try:
        yield
    finally:
        rotator.stop()


def test_a_log_past_the_bound_is_copied_to_dot_1_and_emptied_while_its_server_writes_on(
    tmp_path: Path,
) -> None:
    log = tmp_path / "logs" / "replica-0.log"
    backup = log.with_name("replica-0.log.1")
    with writing_server(log):
        inode = log.stat().st_ino
        with rotating(tmp_path, BOUND):
            assert poll(backup.exists, WAIT_S), "the rotation"
        earlier = numbers(backup)
        assert earlier[0] == 0 and backup.stat().st_size > BOUND
        # the server writes on, into the same file
        assert poll(lambda: len(numbers(log)) > 100, WAIT_S), "lines written since"
        later = numbers(log)
    assert later[0] > earlier[-1] and log.stat().st_ino == inode


def test_a_bound_of_0_never_rotates(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "router.log"
    with writing_server(log), rotating(tmp_path, 0):
        # seconds: dozens of checks
        assert poll(lambda: log.stat().st_size > 4 * BOUND, WAIT_S), "the log to grow"
    assert numbers(log)[0] == 0 and list(log.parent.iterdir()) == [log]
