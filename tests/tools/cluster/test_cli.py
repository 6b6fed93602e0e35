"""`kvtier up`'s signals: a hangup (its terminal closed) stops the fleet as Ctrl-C does, unless
`kvtier up` runs under nohup. The fleet is a stand-in that records its stop."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

# `kvtier up` with a LocalFleet that prints "up" once started and writes `stopped` when stopped
_UP = """
import sys
from pathlib import Path
from kvtier.cli import main
from kvtier.tools.cluster import local_fleet

class Fleet:
    replica_urls, l2_location, url, model_name, prometheus = [], None, "http://x", "m", None
    def __init__(self, spec, monitor):
        pass
    def __enter__(self):
        print("up", flush=True)
        return self
    def __exit__(self, *exc):
        Path(sys.argv[2]).write_text("stopped")

local_fleet.LocalFleet = Fleet
sys.exit(main(["up", "--config", sys.argv[1]]))
"""


def run_up(tmp_path: Path, nohup: bool) -> tuple[subprocess.Popen[str], Path]:
    config, stopped = tmp_path / "fleet.yaml", tmp_path / "stopped"
    config.write_text(f"kvtier: {{workDir: {tmp_path}}}\n")
    command = [sys.executable, "-c", _UP, str(config), str(stopped)]
    up = subprocess.Popen(
        ["nohup", *command] if nohup else command,
        stdout=subprocess.PIPE,
        text=True,
        # as from a terminal, though the tests themselves run under nohup (hangups ignored)
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    assert up.stdout is not None and up.stdout.readline() == "up\n"
    # (a signal inside the stand-in's __enter__ would skip its __exit__: the real fleet stops
    # what it started there itself) wait for `kvtier up`'s last line, its serving loop
    for _ in range(20):
        if "stops everything" in up.stdout.readline():
            break
    return up, stopped


def test_a_hangup_stops_the_fleet(tmp_path: Path) -> None:
    up, stopped = run_up(tmp_path, nohup=False)
    try:
        up.send_signal(signal.SIGHUP)
        up.wait(30)
        assert stopped.read_text() == "stopped"
    finally:
        up.kill()
        up.wait()


def test_under_nohup_a_hangup_is_ignored(tmp_path: Path) -> None:
    up, stopped = run_up(tmp_path, nohup=True)
    try:
        up.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            up.wait(1)
        assert not stopped.exists()
    finally:
        up.kill()
        up.wait()
