"""Start and stop a local fleet: the shared L2, N vLLM replicas with the connector, the router,
and with `monitor`, a Prometheus scraping them (`kvtier.tools.monitoring`).

`LocalFleet(spec)` owns every process it starts (and the L2 server or mount when it started one);
`stop()` ends them all, whatever state start-up reached, even when interrupted. It holds the work
directory's lock from start to stop (one fleet per work directory), and keeps a state file there
from the start of start-up (`kvtier.tools.cluster.state`): it names the owning `kvtier up`
process, so that `kvtier down` can ask it to stop, and what `kvtier down` cleans up should that
process be killed. While the fleet runs, its logs are bounded (`log_rotation`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from tqdm import tqdm

from kvtier.core.errors import KvtierError, run_every
from kvtier.core.parent_watch import STOP_WITH_PARENT_ENV
from kvtier.core.settings import to_flags
from kvtier.net.ports import free_port
from kvtier.net.readiness import wait_ready
from kvtier.router.settings import RouterSettings
from kvtier.tools.cluster.log_rotation import LogRotator
from kvtier.tools.cluster.spec import FleetSpec
from kvtier.tools.cluster.state import (
    RUNNING,
    STARTING,
    Server,
    WorkDirLock,
    check_leftovers,
    left_running,
    names_this_process,
    write_state,
)
from kvtier.tools.embedded_model import resolve_model
from kvtier.tools.monitoring import Prometheus
from kvtier.tools.router_cli import FLAGS as ROUTER_FLAGS
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, QueueWait, ServerProcess, ServerSpec
from kvtier.vllm.settings import kv_transfer_config

if TYPE_CHECKING:
    from kvtier.tools.l2ops.juicefs import JuiceFSMount

STATE_FILE = "cluster.json"
MIB = 1024**2


_MAX_SOCKET_DIR = 90
"""Longest work directory whose `vllm-events-N` and `vllm-replay-N` sockets fit a Unix socket
path (107 bytes)."""
ROUTER_REPLICAS_FILE = "router-replicas.json"
"""The router's replicas with their vLLM event endpoints (`--replicas-file`), in the work dir."""


class LocalFleet:
    """A running fleet; use as a context manager or call `start()` / `stop()`."""

    def __init__(self, spec: FleetSpec, *, progress: bool = True, monitor: bool = False) -> None:
        self.spec = spec
        self.progress = progress
        self.monitor = monitor
        self.prometheus: Prometheus | None = None
        self.work_dir = spec.work_dir.resolve()
        self.model = resolve_model(spec.model)
        self.model_name = Path(self.model).name
        self.replicas: list[ServerProcess] = []
        self.event_endpoints: list[str] = []
        self.vllm_event_endpoints: list[tuple[str, str]] = []
        """Where each replica publishes vLLM's own KV events and answers replays of the ones a
        subscriber missed (none: not published)."""
        self.router: subprocess.Popen[bytes] | None = None
        self.l2_locations: list[str] = []
        self._stack = ExitStack()
        self._lock = WorkDirLock(self.work_dir)
        self._servers: list[Server] = []
        """What would outlive this process, were it killed, recorded in the state file."""
        self._mounts: list[str] = []
        self._log_rotator = LogRotator(self.work_dir, spec.local.log_max_mib * MIB)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.local.router_port}"

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    # ----------------------------------------------------------------------------- start-up
    def start(self) -> Self:
        """Start the fleet. Fails at once, having started nothing and changed nothing of
        another fleet's, where another `kvtier up` holds the work directory (`WorkDirLock`), a
        killed one left servers or mounts running there (`check_leftovers`), or a port is
        taken."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            check_leftovers(self.work_dir / STATE_FILE)
            self._check_ports_free()
            self._write_state(STARTING)
            (self.work_dir / "logs").mkdir(exist_ok=True)
            self._log_rotator.start()
            self._start_l2()
            self._start_replicas()
            self._start_router()
            if self.monitor:
                self.prometheus = Prometheus(
                    self.work_dir / "prometheus",
                    self.url,
                    self.replica_urls,
                    on_started=partial(self._record_server, "prometheus"),
                ).start()
            self._write_state(RUNNING)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_ports_free(self) -> None:
        """Raise `KvtierError` naming the first port the fleet is to listen on that is taken
        (by another `kvtier up` of the same deployment, say): a server already there would
        answer the readiness checks in place of the fleet's own."""
        local = self.spec.local
        ports = {local.router_port: "the router's"} | {
            local.replica_base_port + i: f"replica {i}'s" for i in range(self.spec.replicas)
        }
        for port, whose in ports.items():
            if not _port_free(port):
                raise KvtierError(
                    f"port {port} ({whose}) is taken: another `kvtier up` of this deployment "
                    "or another server listens on it; stop that, or change kvtier.routerPort "
                    "or kvtier.replicaBasePort"
                )

    def _start_l2(self) -> None:
        """Make the shared L2 reachable; one location per replica (a JuiceFS mount each)."""
        cache = self.spec.cache
        if not cache.l2_enabled:
            return
        if cache.l2.kind == "posix":
            path = Path(cache.l2.path) if cache.l2.path else self.work_dir / "l2"
            path.mkdir(parents=True, exist_ok=True)
            self.l2_locations = [str(path)] * self.spec.replicas
        elif cache.l2.kind == "valkey":
            url = cache.l2.url
            if url is None:
                from kvtier.tools.l2ops.valkey_server import (
                    PERSISTENT_L2_APPENDFSYNC,
                    ValkeyServer,
                    ValkeyServerSpec,
                )

                server = ValkeyServer(
                    ValkeyServerSpec(
                        data_dir=str(self.work_dir / "valkey"),
                        maxmemory_bytes=int(cache.l2.size_gib * 1024**3),
                        appendfsync=PERSISTENT_L2_APPENDFSYNC if cache.l2.persistent else None,
                    ),
                    on_started=partial(self._record_server, "valkey server"),
                )
                (self.work_dir / "valkey").mkdir(exist_ok=True)
                url = self._stack.enter_context(server).url
            self.l2_locations = [url] * self.spec.replicas
        else:  # juicefs: each replica mounts the one volume, as separate nodes would
            from kvtier.tools.l2ops.juicefs import JuiceFSVolume, JuiceFSVolumeSpec

            volume = self._stack.enter_context(
                JuiceFSVolume(JuiceFSVolumeSpec(root=str(self.work_dir / "juicefs")))
            )
            for _ in range(self.spec.replicas):
                self.l2_locations.append(volume.mount(on_started=self._record_mount).path)

    @property
    def l2_location(self) -> str | None:
        """What `kvtier up` prints: the L2 every replica shares."""
        return ", ".join(dict.fromkeys(self.l2_locations)) or None

    def connector_config(self, index: int, events_endpoint: str) -> dict[str, Any] | None:
        """`--kv-transfer-config` of replica `index` (None: no connector)."""
        settings = self.spec.connector_settings(
            replica_id=f"http://127.0.0.1:{self.spec.local.replica_base_port + index}",
            events_endpoint=events_endpoint,
            l2_location=self.l2_locations[index] if self.l2_locations else None,
            defaults={"background_cpus": self.background_cpus()},
        )
        return None if settings is None else kv_transfer_config(settings)

    def engines_share_cores(self) -> bool:
        """Whether the replicas' engine threads outnumber the machine's cores."""
        engine_threads = self.spec.replicas * self.spec.local.threads_per_replica
        return engine_threads > (os.cpu_count() or 1)

    def engine_cpus(self, index: int) -> list[int] | None:
        """The cores replica `index`'s engine threads are bound to, a set of its own; None
        (unbound: the kernel shares the cores among the engines) when engine threads outnumber
        the cores. Bound round robin, such engines would pile up unevenly (3 on 2 cores: two on
        one, one alone), and the router, which spreads requests evenly, cannot see that two
        replicas run at half speed (docs/connector.md)."""
        return None if self.engines_share_cores() else self._own_cpus(index)

    def _own_cpus(self, index: int) -> list[int]:
        threads = self.spec.local.threads_per_replica
        return list(range(index * threads, (index + 1) * threads))

    def background_cpus(self) -> str:
        """Where every replica's connector saves and writes (`background_cpus`): the cores no
        engine is bound to, or with none left (or engines unbound), the engine's own
        ("inherit").

        Never another replica's engine cores (the connector's default, the cores its own engine
        is not bound to): each replica runs in its own scheduling group (a session), and a
        thread alone in its group on a core another group keeps busy gets a sliver of it, so a
        5.9 MB copy waited seconds there (docs/connector.md)."""
        if self.engines_share_cores():
            return "inherit"
        engines = {c for i in range(self.spec.replicas) for c in self._own_cpus(i)}
        free = sorted(set(range(os.cpu_count() or 1)) - engines)
        return ",".join(map(str, free)) if free else "inherit"

    def queue_wait(self) -> QueueWait | None:
        """How the engines' processes wait for each other's messages: sleeping
        (`SHARED_MACHINE_WAIT`) when engines share cores, else vLLM's busy-wait. A busy-waiting
        engine process holds a core; where engines share one, it is a core another engine waits
        for, and the fleet loses most of its throughput (docs/connector.md)."""
        return SHARED_MACHINE_WAIT if self.engines_share_cores() else None

    def server_spec(
        self, index: int, events_endpoint: str, vllm_events: tuple[str, str] | None = None
    ) -> ServerSpec:
        """How replica `index`'s vLLM server is started (publishing vLLM's own KV events, if
        `vllm_events` gives their endpoint and the replay endpoint)."""
        return ServerSpec(
            model=self.model,
            port=self.spec.local.replica_base_port + index,
            kv_transfer_config=self.connector_config(index, events_endpoint),
            kv_cache_gib=self.spec.local.engine_kv_cache_gib,
            threads=self.spec.local.threads_per_replica,
            dtype=self.spec.local.engine_dtype,
            cpu_ids=_bind_value(self.engine_cpus(index)),
            queue_wait=self.queue_wait(),
            max_model_len=self._max_model_len(),
            drain_s=self.spec.local.replica_drain_s,
            extra_args=self._engine_args(vllm_events),
            log_path=self.work_dir / "logs" / f"replica-{index}.log",
        )

    def _start_replicas(self) -> None:
        vllm_events = self.spec.local.vllm_kv_events and self.spec.strategy == "kvaware"
        if vllm_events and len(str(self.work_dir)) > _MAX_SOCKET_DIR:
            raise KvtierError(
                f"kvtier.workDir: {self.work_dir} is too long for the replicas' KV-event "
                f"sockets (at most {_MAX_SOCKET_DIR} characters); shorten it, or set "
                "kvtier.vllmKvEvents: false"
            )
        for i in range(self.spec.replicas):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            # (vLLM binds only wildcard and ipc endpoints: it connects to tcp://HOST:PORT)
            vllm = (
                (f"ipc://{self.work_dir}/vllm-events-{i}", f"ipc://{self.work_dir}/vllm-replay-{i}")
                if vllm_events
                else None
            )
            self.replicas.append(ServerProcess(self.server_spec(i, endpoint, vllm)))
            self.event_endpoints.append(endpoint)
            if vllm is not None:
                self.vllm_event_endpoints.append(vllm)
        with tqdm(
            total=len(self.replicas),
            desc="starting replicas",
            unit="replica",
            disable=not self.progress,
        ) as bar:
            for server in self.replicas:
                server.wait_healthy(timeout_s=600)
                bar.update()

    def _max_model_len(self) -> int:
        """8,192 tokens; with a capped engine cache, what vLLM fits into it (-1)."""
        return 8192 if self.spec.local.engine_kv_cache_blocks is None else -1

    def _engine_args(self, vllm_events: tuple[str, str] | None) -> list[str]:
        args = ["--enable-prompt-tokens-details"]
        if vllm_events is not None:
            endpoint, replay = vllm_events
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
            args += ["--kv-events-config", json.dumps({**config, "replay_endpoint": replay})]
        if self.spec.local.engine_kv_cache_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.spec.local.engine_kv_cache_blocks)]
        return args

    def _router_replica_args(self) -> list[str]:
        """The router's flags naming its replicas: their URLs, or, where it follows the
        replicas' vLLM KV events, a replicas file naming each one's event and replay endpoints."""
        if not self.vllm_event_endpoints:
            return to_flags(RouterSettings, {"replicas": self.replica_urls}, ROUTER_FLAGS)
        pairs = zip(self.replica_urls, self.vllm_event_endpoints, strict=True)
        entries = [
            {"url": url, "vllm_events": events, "vllm_events_replay": replay}
            for url, (events, replay) in pairs
        ]
        path = self.work_dir / ROUTER_REPLICAS_FILE
        path.write_text(json.dumps(entries, indent=1) + "\n")
        return ["--replicas-file", str(path)]

    def _start_router(self) -> None:
        values: dict[str, Any] = {
            **self.spec.local.router,
            "port": self.spec.local.router_port,
            "strategy": self.spec.strategy,
            "model_dir": self.model,
        }
        if self.spec.cache.connector_enabled:  # (an empty --events is not a valid flag)
            values["events"] = self.event_endpoints
        cmd = [
            sys.executable,
            "-m",
            "kvtier.cli",
            "router",
            *to_flags(RouterSettings, values, ROUTER_FLAGS),
            *self._router_replica_args(),
        ]
        with open(self.work_dir / "logs" / "router.log", "ab") as log:
            # should this process die without stopping it (kvtier.core.parent_watch)
            grace = f"{os.getpid()} {self.spec.router_drain_s + 10}"
            self.router = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, STOP_WITH_PARENT_ENV: grace},
            )
        wait_ready(self.url + "/health", 120, exited=self.router.poll, what="the router")

    def _record_server(self, name: str, pid: int) -> None:
        """Record in the state file the server `name` just started (as process `pid`), as soon
        as its process exists: one still starting when this process is killed is stopped by
        `kvtier down` all the same."""
        server = Server.of(name, pid)
        if server is not None:
            self._servers.append(server)
            self._write_state(STARTING)

    def _record_mount(self, mount: JuiceFSMount) -> None:
        """Record in the state file the JuiceFS `mount` just started: its mount point (which
        `kvtier down` unmounts only if mounted) and its daemon."""
        self._mounts.append(mount.path)
        self._record_server("juicefs mount", mount.process.pid)

    def _write_state(self, phase: str) -> None:
        """Write the state file: its owner, `phase`, what to clean up were this process
        killed and, once RUNNING, the fleet's URLs."""
        fleet: dict[str, object] = {
            "phase": phase,
            "servers": [asdict(server) for server in self._servers],
            "mounts": self._mounts,
        }
        if phase == RUNNING:
            fleet |= {
                "router": self.url,
                "replicas": self.replica_urls,
                "l2": self.l2_location,
                "dashboard": self.url + "/dashboard",
                "prometheus": self.prometheus.url if self.prometheus is not None else None,
            }
        write_state(self.work_dir / STATE_FILE, fleet)

    # ----------------------------------------------------------------------------- shutdown
    def stop(self) -> None:
        """Stop everything this fleet started, whatever state start-up reached: Prometheus; the
        router and every replica, signalled at once, then waited for while they drain; the L2
        (Valkey server, mounts); the state file, if this process wrote it; the work directory's
        lock. Each step runs even when one before it failed or was interrupted: a Ctrl-C during
        the drain kills the router and the replicas instead. The first exception met is raised
        once all steps have run."""
        try:
            run_every(self._stop_steps())
        finally:
            self.prometheus, self.router = None, None
            self.replicas.clear()

    def _stop_steps(self) -> list[Callable[[], None]]:
        """`stop`'s steps, in order."""
        kills = [server.kill for server in self.replicas]
        if self.router is not None:
            kills.insert(0, partial(_kill, self.router))
        return [
            self._stop_prometheus,
            self._signal_serving,
            self._drain_serving,
            *kills,  # what did not drain (a no-op for what did)
            self._stack.close,
            self._log_rotator.stop,
            self._remove_state,
            self._lock.release,
        ]

    def _stop_prometheus(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()

    def _signal_serving(self) -> None:
        """SIGTERM to the router and every replica: all start draining at once."""
        if self.router is not None:
            self.router.terminate()
        for server in self.replicas:
            server.terminate()

    def _drain_serving(self) -> None:
        """Wait for the router and then each replica to finish its requests in flight and exit,
        each for at most its drain plus a grace (a replica still running then is killed)."""
        if self.router is not None:
            with suppress(subprocess.TimeoutExpired):
                self.router.wait(self.spec.router_drain_s + 10)
        for server in self.replicas:
            server.stop()

    def _remove_state(self) -> None:
        """Remove the state file if this process wrote it (not if another `kvtier up` did),
        unless a server or mount it records did not stop: it stays for `kvtier down`."""
        state = self.work_dir / STATE_FILE
        if names_this_process(state) and not left_running(self._servers, self._mounts):
            state.unlink()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def _port_free(port: int) -> bool:
    """Whether a server can listen on 127.0.0.1:`port` now. Bound as the fleet's servers bind,
    with SO_REUSEADDR, so that connections closed on the port and lingering do not count."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _bind_value(cpus: list[int] | None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `cpus` (None: "nobind", threads left to the kernel)."""
    return "nobind" if cpus is None else ",".join(map(str, cpus))
