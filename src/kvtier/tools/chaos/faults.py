"""The faults `kvtier bench chaos` injects, one at a time, each with its recovery.

A fault is injected (`inject`), held for `hold_s` while the load goes on, then recovered
(`recover`: the process thawed, the mount back, the server up again). The fault's end is when
`recover` returns. `restore` then brings the fleet back to full strength with the load stopped
(a killed replica restarted: on 2 cores an engine start under load takes minutes, and what
clients see of a crash is how the router serves without it, not how long a restart takes).
`failed_part` names the L2 blocks that fault legitimately loses (those it destroyed itself), so
any other block missing afterwards counts as lost beyond it.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.core.codec import HEADER_BYTES, decode_header, encode_header
from kvtier.core.errors import CodecError
from kvtier.core.keys import Namespace
from kvtier.tools.chaos.fleet import ChaosFleet, PhaseName

__all__ = ["FAULTS", "INDEX_BLOCKS", "Fault", "router_metric"]

INDEX_BLOCKS = 'kvtier_router_index_blocks{index="events"}'
"""The router's event-fed index size, on its /metrics."""
STALLS = "kvtier_router_replica_stalls_total"
"""Replicas the router found stalled (summed over replicas)."""


@dataclass
class Fault:
    name: str
    phase: PhaseName
    what: str
    hold_s: float = 5.0
    notes: dict[str, object] = field(default_factory=dict)
    """Figures the fault measures itself (index rebuild time, files on a bare directory)."""

    def inject(self, fleet: ChaosFleet) -> None:
        raise NotImplementedError

    def recover(self, fleet: ChaosFleet) -> None:
        raise NotImplementedError

    def restore(self, fleet: ChaosFleet) -> None:
        """After the measurement, with the load stopped: the fleet at full strength again."""

    def failed_part(self, fleet: ChaosFleet, before: set[str]) -> set[str]:
        return set()


class Control(Fault):
    """No fault: the same windows of load, to show the noise floor of every figure."""

    def inject(self, fleet: ChaosFleet) -> None:
        """Nothing."""

    def recover(self, fleet: ChaosFleet) -> None:
        """Nothing."""


class ReplicaKill(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        fleet.kill_replica(0)

    def recover(self, fleet: ChaosFleet) -> None:
        """Nothing: the crash is the event; the router must route around it."""

    def restore(self, fleet: ChaosFleet) -> None:
        started = time.monotonic()
        fleet.restart_replica(0, timeout_s=300, attempts=2)  # no load now: 35-90 s here
        self.notes["restart_s"] = round(time.monotonic() - started, 1)


class ReplicaFreeze(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        fleet.freeze(1, True)

    def recover(self, fleet: ChaosFleet) -> None:
        fleet.freeze(1, False)


class EngineFreeze(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        self.notes["stalls_before"] = router_metric(fleet, STALLS)
        self.notes["engine_processes"] = fleet.freeze_engine(1, True)

    def recover(self, fleet: ChaosFleet) -> None:
        fleet.freeze_engine(1, False)
        self.notes["stalls"] = router_metric(fleet, STALLS) - float(
            str(self.notes.pop("stalls_before"))
        )


class ReplicaRestart(Fault):
    """Notes how long the stop took, and what the router counted meanwhile: index purges,
    requests it resent off the stopped replica (refused while it drained), times it found the
    replica stopping."""

    def inject(self, fleet: ChaosFleet) -> None:
        victim = fleet.replica(2).url
        self._counters = {
            "purges": "kvtier_router_index_purges_total",
            "resent_off_it": f'kvtier_router_failovers_total{{replica="{victim}"}}',
            "found_stopping": f'kvtier_router_replica_stopping_total{{replica="{victim}"}}',
        }
        self._before = {note: router_metric(fleet, s) for note, s in self._counters.items()}
        self.notes["stop_s"] = round(fleet.restart_replica(2), 1)  # its drain included

    def recover(self, fleet: ChaosFleet) -> None:
        for note, sample in self._counters.items():
            self.notes[note] = router_metric(fleet, sample) - self._before[note]


class RouterKill(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        self.notes["index_before"] = router_metric(fleet, INDEX_BLOCKS)
        fleet.kill_router()

    def recover(self, fleet: ChaosFleet) -> None:
        fleet.restart_router()
        up = time.monotonic()
        deadline = up + 60
        while time.monotonic() < deadline:
            if router_metric(fleet, INDEX_BLOCKS) > 0:
                self.notes["index_rebuilt_s"] = round(time.monotonic() - up, 2)
                time.sleep(1.0)  # the replicas' snapshots land within a second of each other
                self.notes["index_after"] = router_metric(fleet, INDEX_BLOCKS)
                break
            time.sleep(0.2)


class JuiceFSUnmount(Fault):
    """The mount detached lazily, its daemon then gone (as after a crashed FUSE client)."""

    def inject(self, fleet: ChaosFleet) -> None:
        assert fleet.mount is not None and fleet.volume is not None
        old = fleet.mount
        subprocess.run(["fusermount3", "-u", "-z", old.path], check=False)
        old.kill()
        fleet.volume.mounts.remove(old)

    def recover(self, fleet: ChaosFleet) -> None:
        assert fleet.volume is not None and fleet.mount is not None
        bare = [p for p in Path(fleet.mount.path).rglob("*")]
        self.notes["files_on_bare_dir"] = len(bare)
        fleet.mount = fleet.volume.mount(fleet.mount.path)


class MetaKill(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        assert fleet.meta is not None
        fleet.meta.kill()

    def recover(self, fleet: ChaosFleet) -> None:
        assert fleet.meta is not None
        fleet.meta.start()


CORRUPT_OVERRUN_S = 30.0
"""How long past its hold the corruption goes on when `recover` is never called (a run
interrupted or failed during the hold): its thread then stops by itself."""


class Corrupt(Fault):
    """Rewrites block files while replicas read them: flipped bytes, truncation, or another
    model's block (a valid one, under another namespace) in its place, every 0.3 s until
    `recover`, for at most `hold_s` + `CORRUPT_OVERRUN_S`."""

    def inject(self, fleet: ChaosFleet) -> None:
        self._stop = threading.Event()
        self._touched: set[str] = set()
        deadline = time.monotonic() + self.hold_s + CORRUPT_OVERRUN_S
        self._thread = threading.Thread(target=self._loop, args=(fleet, deadline), daemon=True)
        self._thread.start()

    def _loop(self, fleet: ChaosFleet, deadline: float) -> None:
        rng = random.Random(0)
        while not self._stop.wait(0.3) and time.monotonic() < deadline:
            files = fleet.block_files()
            if not files:
                continue
            path = rng.choice(files)
            try:
                data = path.read_bytes()
                if not data:  # truncated to nothing by an earlier rewrite
                    continue
                how = rng.choice(["flip", "truncate", "foreign"])
                if how == "flip":
                    pos = rng.randrange(len(data))
                    data = data[:pos] + bytes([data[pos] ^ 0x40]) + data[pos + 1 :]
                elif how == "truncate":
                    data = data[: rng.randrange(len(data))]
                else:
                    data = _foreign(data)
                _rewrite(path, data)
                self._touched.add(path.name)
            except OSError:
                continue

    def recover(self, fleet: ChaosFleet) -> None:
        self._stop.set()
        self._thread.join(10)
        self.notes["blocks_corrupted"] = len(self._touched)

    def restore(self, fleet: ChaosFleet) -> None:
        """Remove the files it rewrote that are still there: a later fault starts from an L2
        without known-bad blocks (a replica discarding one then would count as a block lost to
        that fault). A replica recomputes and saves them again when a prompt needs them."""
        for path in fleet.block_files():
            if path.name in self._touched:
                path.unlink(missing_ok=True)

    def failed_part(self, fleet: ChaosFleet, before: set[str]) -> set[str]:
        return set(self._touched)


class FaultMode(Fault):
    """faultfs in `mode` for the hold."""

    mode = "eio"
    delay_s = 0.0

    def inject(self, fleet: ChaosFleet) -> None:
        assert fleet.faultfs is not None
        fleet.faultfs.set_mode(self.mode, delay_s=self.delay_s)

    def recover(self, fleet: ChaosFleet) -> None:
        assert fleet.faultfs is not None
        fleet.faultfs.set_mode("ok")


class SlowL2(FaultMode):
    mode = "slow"
    delay_s = 3.0


class DiskFull(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        assert fleet.tmpfs is not None
        self._ballast = fleet.tmpfs / "ballast"
        free = os.statvfs(fleet.tmpfs)
        size = free.f_bavail * free.f_frsize
        with open(self._ballast, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(0, size - 4096))
        self.notes["free_bytes_left"] = os.statvfs(fleet.tmpfs).f_bavail * free.f_frsize

    def recover(self, fleet: ChaosFleet) -> None:
        self._ballast.unlink(missing_ok=True)


class FaultFSUnmount(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        assert fleet.faultfs is not None
        fleet.faultfs.detach()

    def recover(self, fleet: ChaosFleet) -> None:
        assert fleet.faultfs is not None
        self.notes["files_on_bare_dir"] = len(list(Path(fleet.faultfs.mountpoint).rglob("*")))
        fleet.faultfs.mount()


class ValkeyKill(Fault):
    def inject(self, fleet: ChaosFleet) -> None:
        assert fleet.valkey is not None
        fleet.valkey.kill()

    def recover(self, fleet: ChaosFleet) -> None:
        assert fleet.valkey is not None
        started = time.monotonic()
        fleet.valkey.start()  # with an append-only file: once it has loaded it
        self.notes["restart_s"] = round(time.monotonic() - started, 2)
        self.notes["blocks_after_restart"] = len(fleet.l2_blocks())

    def failed_part(self, fleet: ChaosFleet, before: set[str]) -> set[str]:
        assert fleet.valkey is not None
        if fleet.valkey.spec.appendfsync is None:
            return set(before)  # a cache server without persistence: its contents are the failure
        return set()  # its append-only file was synced long before the kill: nothing may be lost


def router_metric(fleet: ChaosFleet, sample: str) -> float:
    from kvtier.tools.bench.client import call

    try:
        status, body = call(fleet.url, "/metrics", timeout_s=5)
    except (OSError, TimeoutError):
        return 0.0
    if status != 200:
        return 0.0
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(sample + " ") or line.startswith(sample + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _rewrite(path: Path, data: bytes) -> None:
    """Replace `path`'s content in place (a reader holding it open sees the change)."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


def _foreign(data: bytes) -> bytes:
    """The same block as another model would have written it: a valid block of another
    namespace (kvtier's file name, another model's content); reversed bytes when `data` is no
    longer a valid block."""
    payload = data[HEADER_BYTES:]
    try:
        header = decode_header(data[:HEADER_BYTES], namespace=_namespace_of(data))
        return encode_header(Namespace("f" * 16), header.block_hash, header.meta, payload) + payload
    except CodecError:  # a block this fault truncated before: no valid header to re-sign
        return data[::-1]


def _namespace_of(data: bytes) -> Namespace:
    return Namespace(data[16:48].rstrip(b"\0").decode("ascii", "replace"))


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in [
        Control("control", "juicefs", "no fault (the noise floor)", 5.0),
        # early, so that every later fault of the phase checks no bad block was saved back
        Corrupt("l2-corrupt", "juicefs", "L2 blocks flipped, truncated, another model's", 10.0),
        ReplicaKill("replica-sigkill", "juicefs", "a replica SIGKILLed, then restarted", 3.0),
        ReplicaFreeze(
            "replica-sigstop", "juicefs", "a replica SIGSTOPped past the health timeout", 6.0
        ),
        EngineFreeze(
            "engine-sigstop", "juicefs", "a replica's engine SIGSTOPped, its API server not", 20.0
        ),
        ReplicaRestart(
            "replica-restart", "juicefs", "a replica stopped (it drains) and started again", 0.0
        ),
        RouterKill("router-kill", "juicefs", "the router SIGKILLed, then restarted", 2.0),
        JuiceFSUnmount("l2-unmount", "juicefs", "the JuiceFS mount detached (umount -z)", 8.0),
        MetaKill("juicefs-meta-kill", "juicefs", "JuiceFS's metadata server SIGKILLed", 5.0),
        FaultMode("l2-eio", "faultfs", "every L2 block read and write fails with EIO", 8.0),
        SlowL2("l2-slow", "faultfs", "every L2 block open waits 3 s", 10.0),
        DiskFull("l2-full", "faultfs", "the L2 file system full (ENOSPC)", 8.0),
        FaultFSUnmount("faultfs-unmount", "faultfs", "the faultfs FUSE mount detached", 6.0),
        ValkeyKill("valkey-kill", "valkey", "the Valkey L2 SIGKILLed, then restarted", 5.0),
    ]
}
"""Every fault, by name, in the order a run injects them."""
