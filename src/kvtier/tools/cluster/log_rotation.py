"""Size-bounded logs of a local fleet: `LogRotator`, a thread of `kvtier up` that copy-truncates
the logs in the work directory while the fleet runs.

The fleet's servers write their logs through descriptors opened for appending (O_APPEND) and kept
for their whole life, so a log cannot be renamed away: they would go on writing to the renamed
file. A log grown past the bound is copied to `<name>.1` (replacing the one before) and truncated
in place instead; each server's next write, appended, lands at the start of the emptied file.
Lines written between the copy and the truncate are lost (a window of one file copy, milliseconds
for a 64 MiB log), and a line being written at the truncate may be split between the two files.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

__all__ = ["CHECK_INTERVAL_S", "LOG_GLOBS", "LogRotator", "rotate"]

log = logging.getLogger(__name__)

LOG_GLOBS = ("logs/*.log", "juicefs/*.log", "valkey/*.log", "prometheus/*.log")
"""The fleet's logs, under its work directory: the replicas' and the router's, the JuiceFS mount
daemons', the Valkey server's, Prometheus'."""
CHECK_INTERVAL_S = 5.0
"""How often `LogRotator` checks the logs' sizes."""


def rotate(path: Path, max_bytes: int) -> bool:
    """Copy-truncate `path` if it holds more than `max_bytes`: copy it to `<path>.1`, replacing
    that, then truncate it to empty (see the module docstring for the lines this may lose).
    Whether it did."""
    if path.stat().st_size <= max_bytes:
        return False
    shutil.copyfile(path, path.with_name(path.name + ".1"))
    os.truncate(path, 0)
    return True


class LogRotator:
    """Between `start()` and `stop()`, a thread that `rotate`s each log of `LOG_GLOBS` under
    `work_dir` past `max_bytes`, every `interval_s`. With `max_bytes` 0 (unbounded) no thread
    starts. A log that cannot be rotated is reported (a warning) and tried again next time."""

    def __init__(
        self, work_dir: Path, max_bytes: int, interval_s: float = CHECK_INTERVAL_S
    ) -> None:
        self.work_dir = work_dir
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start checking (no-op when unbounded or started already)."""
        if self.max_bytes > 0 and self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(
                target=self._run, name="kvtier-log-rotation", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop checking and wait for the thread to end (no-op when not started)."""
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            for path in self._logs():
                try:
                    rotate(path, self.max_bytes)
                except OSError as exc:
                    log.warning("cannot rotate %s: %s", path, exc)

    def _logs(self) -> list[Path]:
        return [path for pattern in LOG_GLOBS for path in self.work_dir.glob(pattern)]
