"""A vLLM OpenAI server as a child process: start, wait until healthy, stop.

Used by `kvtier serve`, the cluster, the tests and the benchmarks, so every server is started
the same way (same thread pinning, offline mode, CPU settings). The owner calls `stop()` (or uses
it as a context manager): vLLM's API server alone gets SIGTERM, so it stops its engine in order
(draining the requests in flight for `ServerSpec.drain_s`); then the process group is killed so
no engine worker outlives it. A SIGTERM to the whole group would stop the engine's workers under
it, and vLLM fails the requests in flight instead of draining them. Should the owner die
without stopping it (SIGKILL, out of memory, its terminal closed), the server stops itself the
same way (`kvtier.core.parent_watch`).

Each server gets a temporary directory of its own (`TMPDIR`, and `VLLM_RPC_BASE_PATH` unless the
user set theirs), removed once it has stopped: vLLM binds its ZMQ IPC sockets (`<uuid4>`, 7
per engine) and writes its torch.distributed init file (`vllm_dist_<hex>`) in the temporary
directory, and leaves them all behind when it stops.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from kvtier.core.errors import KvtierError
from kvtier.core.parent_watch import STOP_WITH_PARENT_ENV
from kvtier.net.readiness import wait_ready
from kvtier.vllm.launch import MQ_RECHECK_ENV, MQ_SPIN_ENV, installed_vllm
from kvtier.vllm.settings import FLUSH_ON_CLOSE_S

RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM binds its ZMQ IPC sockets (vLLM's default: the system's temporary directory)."""
SOCKET_PATH_MAX = 107
"""Longest path a unix socket binds to (`sockaddr_un.sun_path`, less its NUL)."""


@dataclass(frozen=True, slots=True)
class QueueWait:
    """How the engine's processes wait for each other's messages (`kvtier.vllm.launch`)."""

    spin_s: float
    """Busy-wait after each message before sleeping (vLLM: 1 s)."""
    recheck_ms: int
    """Longest sleep before rechecking the queue (vLLM: 5,000 ms)."""


SHARED_MACHINE_WAIT = QueueWait(spin_s=0.0, recheck_ms=2)
"""For engines that share a machine's cores: no busy-wait, a recheck every 2 ms. A busy-waiting
reader holds a core another replica's engine is waiting for (docs/connector.md, "Engines sharing
a machine"); a sleeping one mostly wakes on the recheck rather than vLLM's ping, which costs a
few ms per step."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one vLLM server."""

    model: str
    """Local HF model directory."""
    port: int
    """Loopback port of the OpenAI API."""
    kv_transfer_config: Mapping[str, object] | None = None
    """`--kv-transfer-config` as a dict (None: no connector)."""
    kv_cache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE: the engine's own KV cache (L0) size."""
    max_model_len: int = 8192
    threads: int = 1
    """OpenMP threads; pinned explicitly so servers with and without a connector compare fairly."""
    cpu_ids: str | None = None
    """VLLM_CPU_OMP_THREADS_BIND value, e.g. "0" or "1"; default: first `threads` cores."""
    dtype: str = "auto"
    """Model dtype; "auto" on vLLM's CPU build is bfloat16 where the CPU computes it natively
    (AVX512-BF16 or AMX) and float32 elsewhere, where emulated bf16 is several times slower."""
    queue_wait: QueueWait | None = None
    """None: vLLM's own waits (one core busy per waiting engine process)."""
    drain_s: int = 0
    """`--shutdown-timeout`: on SIGTERM, requests in flight may finish for this long; new ones
    are refused (HTTP 500). 0: vLLM aborts the requests in flight at once."""
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "kvtier.vllm.launch",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--served-model-name",
            Path(self.model).name,
            "--dtype",
            resolve_dtype(self.dtype),
            "--shutdown-timeout",
            str(self.drain_s),
        ]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd + list(self.extra_args)

    def environment(self, temp_dir: str | None = None) -> dict[str, str]:
        """The server's environment; with `temp_dir`, its temporary files go there (see the
        module docstring), and its IPC sockets too unless VLLM_RPC_BASE_PATH is set."""
        env = dict(os.environ)
        bind = self.cpu_ids or ",".join(str(i) for i in range(self.threads))
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_CI_ENV": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": bind,
                "OMP_NUM_THREADS": str(self.threads),
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        if self.queue_wait is not None:
            env[MQ_SPIN_ENV] = str(self.queue_wait.spin_s)
            env[MQ_RECHECK_ENV] = str(self.queue_wait.recheck_ms)
        if temp_dir is not None:
            env["TMPDIR"] = temp_dir
            if RPC_DIR_ENV not in env:  # the user's own wins (as does `env`, applied last)
                env[RPC_DIR_ENV] = temp_dir
        env.update(self.env)
        return env


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """The dtype to pass vLLM (see `ServerSpec.dtype`)."""
    if dtype != "auto":
        return dtype
    found = installed_vllm()
    if found is not None and found[0] == "vllm-cpu":
        return "bfloat16" if native_bf16() else "float32"
    return "auto"


STOP_GRACE_S = 10.0 + FLUSH_ON_CLOSE_S
"""How long `ServerProcess.stop` waits, beyond the drain, for vLLM to exit on its own: its
engine's teardown, in which the connector writes out the L2 saves still queued."""


LOG_TAIL_LINES = 20
"""How many of a server's last log lines the error of a failed start quotes."""


class ServerProcess:
    """A running vLLM server; `stop()` ends it and its whole process group."""

    def __init__(self, spec: ServerSpec) -> None:
        """Start the server; raises `KvtierError`, starting nothing, if its port is taken (a
        server already there would answer the health checks in its place)."""
        if not _port_free(spec.port):
            raise KvtierError(
                f"port {spec.port} is taken: another server listens on 127.0.0.1:{spec.port}; "
                "stop it or choose another port"
            )
        self.spec = spec
        self.url = f"http://127.0.0.1:{spec.port}"
        self.temp_dir = _temp_dir()
        """The server's own temporary directory, removed once it has stopped."""
        self._killed = False
        try:
            env = spec.environment(self.temp_dir)
            # should this process die without stopping the server (kvtier.vllm.launch)
            grace = spec.drain_s + STOP_GRACE_S
            env[STOP_WITH_PARENT_ENV] = f"{os.getpid()} {grace} {self.temp_dir}"
            with ExitStack() as stack:
                log = (
                    stack.enter_context(open(spec.log_path, "ab"))
                    if spec.log_path
                    else subprocess.DEVNULL
                )
                self._proc = subprocess.Popen(
                    spec.command(),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except BaseException:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Return once `/health` answers; else kill the server and raise `KvtierError` (as soon
        as it exits, or after `timeout_s`) quoting its log's last lines."""
        try:
            wait_ready(
                self.url + "/health",
                timeout_s,
                exited=self._proc.poll,
                what=f"vLLM server on port {self.spec.port} (log: {self.spec.log_path})",
                interval_s=0.5,
            )
        except KvtierError as exc:
            self.kill()  # it never served: nothing to drain
            raise KvtierError(f"{exc}{self._log_tail()}") from exc

    def _log_tail(self) -> str:
        """The log's last `LOG_TAIL_LINES` lines, indented, after a newline ("" without any)."""
        if self.spec.log_path is None:
            return ""
        try:
            with open(self.spec.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
                lines = log.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            return ""
        return "".join(f"\n  | {line}" for line in lines)

    def kill(self) -> None:
        """Hard-kill the process group (a failed start; tests of failover). Signals it once:
        once killed and reaped, its id is free, and may come to name another process group."""
        if not self._killed:
            self._signal(signal.SIGKILL)
            self._proc.wait()
            self._killed = True
        self._remove_temp_dir()

    def terminate(self) -> None:
        """Start a graceful stop: SIGTERM to the API server alone, which drains and stops the
        engine (returns at once; `stop()` waits)."""
        if self._proc.poll() is None:
            self._proc.terminate()

    def stop(self) -> None:
        """Stop gracefully (see `terminate`), waiting up to the drain plus `STOP_GRACE_S`, then
        kill whatever is left of the process group; interrupted while it waits (a second
        Ctrl-C), it kills the group at once and re-raises."""
        try:
            self.terminate()
            self._proc.wait(self.spec.drain_s + STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()  # also reaps stray workers of an exited server

    def _remove_temp_dir(self) -> None:
        """Remove the server's temporary directory (its group is gone: nothing writes there)."""
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_free(port: int) -> bool:
    """Whether no server listens on 127.0.0.1:`port` now (another refusal, e.g. a privileged
    port, is left for vLLM to report). Bound with SO_REUSEADDR, as servers bind, so that closed
    connections lingering on the port do not count."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def _temp_dir() -> str:
    """A new directory for one server's temporary files, in the system's temporary directory,
    or in /tmp where that would make vLLM's socket paths (a uuid4 in it) too long to bind."""
    path = tempfile.mkdtemp(prefix="kvtier-vllm-")
    if len(os.fsencode(path)) + len("/") + 36 > SOCKET_PATH_MAX:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="kvtier-vllm-", dir="/tmp")
    return path


def start_server(spec: ServerSpec, timeout_s: float = 300.0) -> ServerProcess:
    """Start a server and wait until `/health` answers; stops it again on failure."""
    server = ServerProcess(spec)
    try:
        server.wait_healthy(timeout_s)
    except BaseException:
        server.stop()
        raise
    return server
