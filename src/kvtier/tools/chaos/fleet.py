"""The fleet `kvtier bench chaos` injects faults into: 3 replicas, the router, and a shared L2 of
the kind a phase needs, with handles for every fault.

    juicefs   one JuiceFS mount shared by the replicas; its metadata in a Valkey server that
              persists (AOF, fsync always), so killing and restarting it loses nothing
    faultfs   `kvtier.tools.chaos.faultfs` over a small tmpfs: EIO, slow reads, a full disk,
              and a FUSE mount to pull from under the replicas
    valkey    a Valkey server as the L2

`ChaosFleet` wraps `kvtier.tools.cluster.local_fleet.LocalFleet` (replicas and router) and owns
the L2 pieces it starts; `stop()` ends everything, whatever state a fault or a failed start
left it in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Self, cast

import psutil

from kvtier.core.errors import KvtierError, TierError, run_every
from kvtier.net.ports import free_port, free_port_range
from kvtier.net.readiness import wait_ready
from kvtier.router.settings import Strategy
from kvtier.tools.chaos.faultfs import FaultFS
from kvtier.tools.cluster.local_fleet import LocalFleet
from kvtier.tools.cluster.spec import CacheSpec, FleetSpec, L2Spec, LocalSpec, RoutingSpec
from kvtier.tools.l2ops.juicefs import JuiceFSMount, JuiceFSVolume, JuiceFSVolumeSpec, mounted_under
from kvtier.tools.l2ops.valkey_server import (
    PERSISTENT_L2_APPENDFSYNC,
    ValkeyServer,
    ValkeyServerSpec,
)
from kvtier.tools.vllm_server import ServerProcess

__all__ = ["ChaosFleet", "FleetOptions", "PhaseName"]

PhaseName = Literal["juicefs", "faultfs", "valkey"]
TMPFS_BYTES = 400 * 1024 * 1024
"""Size of the faultfs phase's tmpfs: ~65 blocks of the embedded model (the load stores ~30)."""
TMPFS_UNMOUNTS: Final = 5
"""Most `umount -l` calls `stop()` makes to detach the tmpfs (one per mount stacked there)."""

ENGINE_DTYPE: Final = "float32"
"""Every answer is compared with one reference, but how much of a prompt comes from a cache (L0
or a kvtier tier, at its own block size) changes how its prefill is split, and so the logits'
last digits: in bfloat16 (vLLM's choice on a CPU with native bf16) that flips near-tied greedy
tokens; float32 keeps the comparison about the cache's correctness (docs/reliability.md)."""
ROUTER = {"health_interval_s": 0.5, "health_timeout_s": 1.0, "stall_after_s": 5.0}
"""The router's checks, tight: a replica lost or stalled leaves rotation within seconds."""


@dataclass(frozen=True, slots=True)
class FleetOptions:
    model: str | None = None
    replicas: int = 3
    engine_blocks: int = 24
    """Engine (L0) cache per replica in 128-token blocks: small, so prompts reach L1 and L2."""
    l1_gib: float = 0.06
    """L1 per replica: about ten blocks of the embedded model."""
    strategy: str = "kvaware"
    connector: tuple[tuple[str, Any], ...] = ()
    """Extra connector settings, e.g. (("load_async", True),)."""


class ChaosFleet:
    def __init__(self, phase: PhaseName, work_dir: Path, options: FleetOptions) -> None:
        self.phase = phase
        self.work_dir = work_dir.resolve()
        self.options = options
        self.fleet: LocalFleet | None = None
        self.meta: ValkeyServer | None = None
        self.volume: JuiceFSVolume | None = None
        self.mount: JuiceFSMount | None = None
        self.faultfs: FaultFS | None = None
        self.tmpfs: Path | None = None
        self.valkey: ValkeyServer | None = None
        self.l2_path: str | None = None

    # ----- start and stop -----

    def start(self, progress: bool = False) -> Self:
        """Start the phase's L2 (empty: what an earlier run left there is removed), the
        replicas and the router."""
        if left := mounted_under(str(self.work_dir)):
            raise TierError(f"{self.work_dir}: still mounted from an earlier run: {left}")
        for stale in ("jfs", "meta", "valkey", "fleet"):
            shutil.rmtree(self.work_dir / stale, ignore_errors=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            l2 = self._start_l2()
            opts = self.options
            spec = FleetSpec(
                model=opts.model,
                replicas=opts.replicas,
                routing=RoutingSpec(strategy=cast(Strategy, opts.strategy)),
                cache=CacheSpec(l1_gib=opts.l1_gib, l2=l2),
                local=LocalSpec(
                    router_port=free_port(),
                    replica_base_port=free_port_range(opts.replicas),
                    engine_kv_cache_blocks=opts.engine_blocks,
                    engine_dtype=ENGINE_DTYPE,
                    work_dir=str(self.work_dir / "fleet"),
                    connector=dict(opts.connector),
                    router=ROUTER,
                ),
            )
            self.fleet = LocalFleet(spec, progress=progress).start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_l2(self) -> L2Spec:
        if self.phase == "valkey":
            # as `kvtier up` runs it with l2CachePersistent: a restart keeps the blocks
            self.valkey = ValkeyServer(
                ValkeyServerSpec(
                    data_dir=str(self.work_dir / "valkey"),
                    maxmemory_bytes=1 << 30,
                    appendfsync=PERSISTENT_L2_APPENDFSYNC,
                )
            )
            self.valkey.start()
            return L2Spec(backend="valkey", url=self.valkey.url)
        if self.phase == "juicefs":
            self.meta = ValkeyServer(
                ValkeyServerSpec(
                    data_dir=str(self.work_dir / "meta"),
                    maxmemory_bytes=0,
                    maxmemory_policy="noeviction",
                    appendfsync="always",
                )
            )
            (self.work_dir / "meta").mkdir(exist_ok=True)
            self.meta.start()
            self.volume = JuiceFSVolume(
                JuiceFSVolumeSpec(root=str(self.work_dir / "jfs"), meta_url=self.meta.url + "/1")
            )
            self.mount = self.volume.mount()
            self.l2_path = self.mount.path
        else:
            self.tmpfs = self.work_dir / "backing"
            self.tmpfs.mkdir(exist_ok=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(self.tmpfs)],
                check=True,
            )
            self.faultfs = FaultFS(
                str(self.tmpfs), str(self.work_dir / "l2"), str(self.work_dir / "faultfs.log")
            )
            self.faultfs.set_mode("ok")  # not the fault an interrupted run left in force
            self.faultfs.mount()
            self.l2_path = self.faultfs.mountpoint
        return L2Spec(backend="posix", path=self.l2_path)

    def stop(self) -> None:
        """Stop everything this fleet started, whatever state a fault or a failed start left
        it in: the replicas and the router (thawed first), then the L2 pieces, the FUSE layers
        before what they stand on. Each step runs even when one before it failed or was
        interrupted (a second Ctrl-C during the drain); the first exception met is raised once
        all steps have run."""
        run_every(self._stop_steps())

    def _stop_steps(self) -> list[Callable[[], None]]:
        """`stop`'s steps, in order (each a no-op for what was not started)."""
        steps: list[Callable[[], None]] = [self._stop_fleet]
        if self.volume is not None:
            steps.append(self.volume.close)
        if self.meta is not None:
            steps.append(self.meta.stop)
        if self.faultfs is not None:
            steps.append(self.faultfs.unmount)
        if self.tmpfs is not None:
            steps.append(self._unmount_tmpfs)
        if self.valkey is not None:
            steps.append(self.valkey.stop)
        return steps

    def _stop_fleet(self) -> None:
        """Thaw and stop the replicas and the router (`LocalFleet.stop`), once."""
        fleet, self.fleet = self.fleet, None
        if fleet is None:
            return
        for server in fleet.replicas:
            _signal_group(server.pid, signal.SIGCONT)  # a frozen replica cannot stop
        if fleet.router is not None:
            _signal_group(fleet.router.pid, signal.SIGCONT)
        fleet.stop()

    def _unmount_tmpfs(self) -> None:
        """Detach the faultfs phase's tmpfs lazily (a replica may still hold a file there),
        every mount stacked on it; raises `TierError` if it is still mounted after
        `TMPFS_UNMOUNTS` tries."""
        assert self.tmpfs is not None
        for _ in range(TMPFS_UNMOUNTS):
            if not os.path.ismount(self.tmpfs):
                return
            subprocess.run(["umount", "-l", str(self.tmpfs)], check=False, timeout=30)
        if os.path.ismount(self.tmpfs):
            raise TierError(f"could not unmount the tmpfs at {self.tmpfs}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- what the load and the faults need -----

    @property
    def running(self) -> LocalFleet:
        assert self.fleet is not None, "start() first"
        return self.fleet

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def model_name(self) -> str:
        return self.running.model_name

    def replica(self, i: int) -> ServerProcess:
        return self.running.replicas[i]

    def freeze(self, i: int, frozen: bool) -> None:
        _signal_group(self.replica(i).pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def freeze_engine(self, i: int, frozen: bool) -> int:
        """SIGSTOP (SIGCONT) replica `i`'s engine processes, not its API server: /health stays
        green while its requests hang (a gray failure). Returns how many processes."""
        try:
            engine = psutil.Process(self.replica(i).pid).children(recursive=True)
        except psutil.Error:
            return 0
        for proc in engine:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)
        return len(engine)

    def kill_replica(self, i: int) -> None:
        self.replica(i).kill()

    def restart_replica(self, i: int, timeout_s: float = 600, attempts: int = 1) -> float:
        """Stop replica `i` (gracefully: it drains) and start it again, waiting `timeout_s` per
        attempt; returns how long the stop took. A start that hangs (a vLLM worker that never
        logs, seen on this 2-core machine) is stopped and started once more when `attempts`
        allows."""
        old = self.replica(i)
        started = time.monotonic()
        old.stop()
        stop_s = time.monotonic() - started
        for attempt in range(1, attempts + 1):
            new = ServerProcess(old.spec)
            self.running.replicas[i] = new
            try:
                new.wait_healthy(timeout_s)  # stops the server when it does not come up
                break
            except KvtierError:
                if attempt == attempts:
                    raise
        return stop_s

    def kill_router(self) -> None:
        router = self.running.router
        assert router is not None
        _signal_group(router.pid, signal.SIGKILL)
        router.wait(10)

    def restart_router(self) -> None:
        self.running._start_router()  # the same command `kvtier up` started it with

    def all_healthy(self) -> bool:
        from kvtier.tools.bench.client import call

        try:
            status, body = call(self.url, "/health", timeout_s=5)
        except (OSError, TimeoutError):
            return False
        import json

        return status == 200 and len(json.loads(body)["healthy_replicas"]) == len(
            self.running.replicas
        )

    def wait_all_healthy(self, timeout_s: float = 120) -> float:
        """Seconds until the router sees every replica healthy; raises on timeout."""
        start = time.monotonic()
        while not self.all_healthy():
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"fleet not healthy within {timeout_s} s")
            time.sleep(0.25)
        return time.monotonic() - start

    def wait_router(self, timeout_s: float = 120) -> None:
        router = self.running.router
        wait_ready(self.url + "/health", timeout_s, exited=None if router is None else router.poll)

    # ----- inventory: L2 blocks, processes, mounts -----

    def l2_blocks(self) -> set[str]:
        """Names of the blocks the L2 holds now (a Valkey L2: its keys)."""
        if self.valkey is not None:
            import valkey

            client = valkey.Valkey(host="127.0.0.1", port=self.valkey.port, socket_timeout=5)
            try:
                return {k.decode() for k in client.scan_iter(count=1000) if b"manifest" not in k}
            except valkey.exceptions.ValkeyError:
                return set()
            finally:
                client.close()  # type: ignore[no-untyped-call]
        root = self.tmpfs if self.tmpfs is not None else self.l2_path
        if root is None:
            return set()
        return {p.name for p in _walk(Path(root)) if p.name.endswith(".kvt")}

    def block_files(self) -> list[Path]:
        """Block files as seen from the machine (the backing store under a FUSE layer)."""
        root = self.tmpfs if self.tmpfs is not None else self.l2_path
        return [] if root is None else [p for p in _walk(Path(root)) if p.name.endswith(".kvt")]

    def mounts(self) -> list[str]:
        return mounted_under(str(self.work_dir))

    def processes(self) -> list[str]:
        """Descriptions of every live process this fleet started (children of this process)."""
        me = psutil.Process()
        found = []
        for child in me.children(recursive=True):
            try:
                found.append(f"{child.pid}:{child.name()}")
            except psutil.Error:
                continue
        return sorted(found)

    def tree_usage(self, pid: int) -> tuple[int, int]:
        """(resident bytes, open file descriptors) of a process and its descendants."""
        rss = fds = 0
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    rss += proc.memory_info().rss
                    fds += proc.num_fds()
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return rss, fds


def _walk(root: Path) -> Iterator[Path]:
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if not entry.name.startswith("."):
                    yield from _walk(Path(entry.path))
            else:
                yield Path(entry.path)
        except OSError:
            continue


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
