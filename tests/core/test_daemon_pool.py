"""DaemonPool: the Executor contract on daemon threads, with a bounded wait."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvtier.core.daemon_pool import DaemonPool


def test_calls_run_in_the_pool_and_their_results_and_errors_reach_the_futures() -> None:
    seen: list[str] = []
    pool = DaemonPool(2, "test-pool", lambda: seen.append(threading.current_thread().name))
    try:
        assert list(pool.map(lambda x: x * x, range(5))) == [0, 1, 4, 9, 16]
        failing = pool.submit(int, "not a number")
        with pytest.raises(ValueError):
            failing.result(10)
        assert sorted(seen) == ["test-pool_0", "test-pool_1"]  # the initializer, once each
    finally:
        pool.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(int, "1")


def test_shutdown_cancels_queued_calls_and_join_gives_up_on_a_stuck_one() -> None:
    release = threading.Event()
    pool = DaemonPool(1, "test-pool")
    try:
        stuck = pool.submit(release.wait, 30)
        queued = pool.submit(int, "1")
        while not stuck.running():
            time.sleep(0.01)
        pool.shutdown(wait=False, cancel_futures=True)
        assert queued.cancelled()
        started = time.monotonic()
        assert pool.join(0.3) is False
        assert time.monotonic() - started < 5
    finally:
        release.set()
    assert pool.join(10) is True
    assert stuck.result() is True


def test_a_thread_stuck_for_good_does_not_keep_the_process_alive() -> None:
    """What a read in a hung mount does: the interpreter still exits (a ThreadPoolExecutor
    joins its threads at exit and would wait forever)."""
    script = (
        "import threading\n"
        "from kvtier.core.daemon_pool import DaemonPool\n"
        "pool = DaemonPool(1, 'stuck')\n"
        "pool.submit(threading.Event().wait)\n"
        "pool.shutdown(wait=False)\n"
        "print('left', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "left\n"
