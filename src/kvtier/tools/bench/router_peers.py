"""The routers `kvtier bench router` compares, each started in its own process group.

kvtier's own strategies through `kvtier router`; sglang-router and vllm-router (Rust, PyPI,
installed by hand as benchmark peers); round robin and least load; and `passthrough`, kvtier's
HTTP stack forwarding without parsing or routing (the floor the routing work adds to). The
fake replicas the hop is measured against are `kvtier.tools.fake_replica` processes.

    python -m kvtier.tools.bench.router_peers --passthrough PORT UPSTREAM_URL
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.core.errors import KvtierError
from kvtier.core.parent_watch import STOP_WITH_PARENT_ENV, stop_with_parent
from kvtier.net.ports import free_port
from kvtier.net.readiness import wait_ready

__all__ = [
    "PASSTHROUGH",
    "ROUTERS",
    "Replica",
    "RouterProcess",
    "router_command",
    "start_fake_replica",
    "stop_fake_replica",
]

ROUTERS = (
    "kvtier-prefixaware",
    "kvtier-kvaware",
    "roundrobin",
    "leastload",
    "sglang-router",
    "vllm-router",
)
PASSTHROUGH = "passthrough"
"""Overhead reference: kvtier's HTTP stack forwarding without parsing or routing."""
ROUTER_STOP_GRACE_S = 10
"""A kvtier router (or the passthrough) whose benchmark died: seconds from its SIGTERM (a
drain) to its SIGKILL (`kvtier.core.parent_watch`)."""
FAKE_STOP_GRACE_S = 2
"""The same for a fake replica, which has nothing to drain."""


# ----- the routers under test -----


@dataclass(frozen=True, slots=True)
class Replica:
    url: str
    events: str | None = None
    """vLLM KV-event endpoint (kvaware only)."""


def router_command(name: str, replicas: Sequence[Replica], port: int) -> list[str]:
    """The command starting router `name` on `port` in front of `replicas`."""
    urls = [r.url for r in replicas]
    base = [sys.executable, "-m", "kvtier.cli", "router", "--port", str(port), "--seed", "0"]
    kvtier_strategy = {
        "kvtier-prefixaware": "prefixaware",
        "kvtier-kvaware": "kvaware",
        "roundrobin": "roundrobin",
        "leastload": "leastload",
    }
    if name == "kvtier-kvaware":
        return (
            base
            + ["--strategy", "kvaware"]
            + [
                a
                for r in replicas
                for a in ("--replica", r.url + (f"={r.events}" if r.events else ""))
            ]
        )
    if name in kvtier_strategy:
        return (
            base
            + ["--strategy", kvtier_strategy[name]]
            + [a for u in urls for a in ("--replica", u)]
        )
    # Both Rust routers open a Prometheus listener, by default on one fixed port (29000): give
    # each its own loopback port so several can run at once.
    rust_args = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        "cache_aware",
        "--worker-urls",
        *urls,
    ]
    # Both log a line per request at their default level (INFO); kvtier logs none: warnings
    # only, so every router pays for the same logging.
    if name == "sglang-router":
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            *rust_args,
            "--log-level",
            "warn",
        ]
    if name == "vllm-router":
        exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
        return [exe, *rust_args, "--log-level", "warning"]
    if name == PASSTHROUGH:
        return [
            sys.executable,
            "-m",
            "kvtier.tools.bench.router_peers",
            "--passthrough",
            str(port),
            urls[0],
        ]
    raise ValueError(f"unknown router {name!r}")


def pinned_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` binding the child to `cpus` (its threads and children inherit it)."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


class RouterProcess:
    """A router under test in its own process group, on `cpus` when given; `stop()` ends the
    whole group."""

    def __init__(
        self,
        name: str,
        replicas: Sequence[Replica],
        log_dir: Path,
        cpus: set[int] | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"router-{name}-{self.port}.log"
        cmd = router_command(name, replicas, self.port)
        if name == "vllm-router" and not Path(cmd[0]).exists():
            raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # (kvtier's routers stop should this process die first; the others ignore it)
                env={
                    **os.environ,
                    "HF_HUB_OFFLINE": "1",
                    STOP_WITH_PARENT_ENV: f"{os.getpid()} {ROUTER_STOP_GRACE_S}",
                },
                preexec_fn=pinned_to(cpus),
            )

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def ready(self, timeout_s: float = 120.0) -> None:
        try:
            await asyncio.to_thread(
                wait_ready, self.url + "/health", timeout_s, exited=self._proc.poll, what=self.name
            )
        except KvtierError as exc:
            raise RuntimeError(f"{exc}: {self.log.read_text()[-400:].strip()}") from None

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue


def _passthrough_main(port: int, upstream: str) -> None:
    """Forward every completion to `upstream` untouched, on the router's own HTTP stack and
    event loop: the floor next to which the routers' overheads can be read."""
    import socket

    from kvtier.net.http_client import HttpPool
    from kvtier.net.http_server import JSON_HEADERS, Exchange, HttpServer, fast_loop_factory

    pool = HttpPool(5.0, 60.0)

    async def forward(exchange: Exchange) -> None:
        if exchange.path == "/health":
            await exchange.respond(200, b"ok", [])
            return
        body = await exchange.body(64 * 1024 * 1024)
        resp = await pool.post(
            upstream, "/v1/completions", body, [("Content-Type", "application/json")]
        )
        try:
            await exchange.respond(resp.status, await resp.read(), JSON_HEADERS)
        finally:
            resp.close()

    with (
        socket.create_server(("127.0.0.1", port)) as sock,
        asyncio.Runner(loop_factory=fast_loop_factory()) as runner,
    ):
        runner.run(HttpServer(forward).serve(sock))


def start_fake_replica(
    log_dir: Path, cpus: set[int] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a fake replica (`kvtier.tools.fake_replica`) in a process group of its own, on
    `cpus` when given, and wait until it answers; returns it and its URL. Failing or
    interrupted while it waits, it kills the fake first (see `stop_fake_replica`)."""
    port = free_port()
    with open(log_dir / f"fake-{port}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.tools.fake_replica", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=pinned_to(cpus),
            env={**os.environ, STOP_WITH_PARENT_ENV: f"{os.getpid()} {FAKE_STOP_GRACE_S}"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", 60, exited=proc.poll, what="the fake replica")
    except BaseException:
        stop_fake_replica(proc)
        raise
    return proc, url


def stop_fake_replica(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a fake replica's process group and reap it (nothing once reaped: its id may
    name another group by then)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--passthrough":
        stop_with_parent()
        _passthrough_main(int(sys.argv[2]), sys.argv[3])
