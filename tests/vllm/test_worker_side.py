"""The worker side without vLLM's engine: real paged KV tensors, real stores on one L2 directory.

Replica A saves computed blocks (one copy into L1, written through to L2); replica B loads them
from L2 through its staging buffer into other engine blocks, byte for byte, without promoting
them, then promotes them by saving them from its own cache. A saver that cannot keep up drops
saves instead of holding the engine's blocks, and background threads leave the engine's CPUs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.core.keys import block_hashes, root_hash
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import Tier
from kvtier.vllm.metadata import KvtierMetadata, LoadSpec, SaveSpec
from kvtier.vllm.process_store import HashAliases, ProcessStore, model_identity
from kvtier.vllm.settings import ConnectorSettings
from kvtier.vllm.stats import ConnectorCounters
from kvtier.vllm.worker_side import WorkerSide, background_cpus, thread_placer
from tests.helpers.worker_side import (
    CHAIN,
    PARENTS,
    TOKENS,
    close_replica,
    geometry,
    replica,
    save_blocks,
    save_step,
    wait_loaded,
)


def _layers(side: WorkerSide, caches: dict[str, torch.Tensor]) -> None:
    """What a forward pass does: wait for each layer before reading it."""
    for name in caches:
        side.wait_for_layer(name)


def _forward(side: WorkerSide, caches: dict[str, torch.Tensor]) -> None:
    """What vLLM does around a forward pass: wait for each layer, then `wait_for_save`."""
    _layers(side, caches)
    side.submit_saves(KvtierMetadata())


def test_blocks_saved_on_one_replica_load_byte_for_byte_on_another(tmp_path: Path) -> None:
    a, a_caches = replica(tmp_path)
    # the copy before the forward pass, from the staging buffer (the layered path: below)
    b, b_caches = replica(
        tmp_path, save_backlog_blocks=64, load_read_threads=2, load_layerwise=False
    )
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        assert a._counters.totals()["save_blocks"] == 3
        assert a._counters.totals()["save_cpu_seconds"] > 0

        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        for name in a_caches:
            assert torch.equal(b_caches[name][1:4], a_caches[name][7:10])
        assert b.load_errors() == set()
        totals = b._counters.totals()
        assert totals["load_blocks_l2"] == 3 and totals["load_failed_blocks"] == 0
        assert totals["phase_read_seconds"] > 0 and totals["phase_copy_seconds"] > 0
        assert not any(b._store.has_near(h) for h in CHAIN)  # not promoted on the load

        save_blocks(b, "hit", (1, 2, 3), promote=frozenset({0, 1, 2}))  # loaded: promoted into L1
        assert all(b._store.has_near(h) for h in CHAIN)
        assert [blk.tier for blk in b._store.load(CHAIN)] == [Tier.L1] * 3
        save_blocks(b, "again", (1, 2, 3))  # L1 holds them now: skipped
        assert b._counters.totals()["save_skipped_blocks"] == 3
    finally:
        close_replica(a)
        close_replica(b)


def test_a_load_that_skips_locally_computed_engine_blocks_keeps_them(tmp_path: Path) -> None:
    a, a_caches = replica(tmp_path)
    b, b_caches = replica(tmp_path, load_staging=False)
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        before = {n: t[4].clone() for n, t in b_caches.items()}
        # per_block is 1 here, so a skip applies to nothing: load blocks 1..2 only
        load = LoadSpec("hit", CHAIN[1:], (4, 5), 0, (Tier.L2,) * 2, asynchronous=True)
        b.start_loads(KvtierMetadata(loads=[load]))
        wait_loaded(b, "hit")
        for name in a_caches:
            assert torch.equal(b_caches[name][4:6], a_caches[name][8:10])
            assert not torch.equal(b_caches[name][4], before[name])
        assert all(b._store.has_near(h) for h in CHAIN[1:])  # unstaged: promoted at once
    finally:
        close_replica(a)
        close_replica(b)


def test_a_missing_block_fails_the_rest_of_the_load(tmp_path: Path) -> None:
    b, _ = replica(tmp_path)
    try:
        load = LoadSpec("miss", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        assert b.load_errors() == {1, 2, 3}
    finally:
        close_replica(b)


def test_a_step_never_saves_the_blocks_its_load_left_unwritten(tmp_path: Path) -> None:
    """Block 1 of 3 is gone from L2: this step's save (which vLLM plans over every block of
    the prompt) must not copy blocks 1-2, whose engine blocks hold stale KV until vLLM
    recomputes them; the next step's save, after the recompute, does."""
    a, _ = replica(tmp_path)
    b, b_caches = replica(tmp_path)
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        os.unlink(a._store._l2.path(CHAIN[1]))  # a corrupt file the loader removed, say
        load = LoadSpec("cut", CHAIN[1:], (5, 6), 0, (Tier.L2,) * 2, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))  # fails at its first block: nothing to save
        save_blocks(
            b, "cut", (5, 6)
        )  # still reported finished, or vLLM would never free its blocks
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        _layers(b, b_caches)
        save_blocks(b, "hit", (1, 2, 3))  # the same step: before vLLM has seen the load errors
        assert b.load_errors() == {2, 3, 5, 6}
        assert b._store.flush(30)
        assert [b._store.contains(h) is not None for h in CHAIN] == [True, False, True]
        for name in b_caches:  # vLLM recomputes blocks 1-2 into engine blocks 2-3
            b_caches[name][2:4] = 0.5
        save_blocks(b, "hit", (1, 2, 3))  # a later step: computed now
        assert b._store.flush(30)
        (stored,) = b._store.load([CHAIN[0], CHAIN[1]])[1:]
        assert stored is not None and bytes(stored.payload) == bytes(
            torch.stack([b_caches[n][2] for n in b_caches]).numpy().tobytes()
        )
    finally:
        close_replica(a)
        close_replica(b)


def test_a_request_reading_a_block_that_failed_to_load_saves_nothing_computed_from_it(
    tmp_path: Path,
) -> None:
    """Request "a" loads blocks 0-2, block 1 is gone; "b", scheduled in the same step, found
    blocks 0-1 in vLLM's prefix cache (a's engine blocks, `loaded_before`) and computed
    block 2 from them: none of b's blocks is saved. "c", on its own blocks, is saved."""
    a, _ = replica(tmp_path)
    b, b_caches = replica(tmp_path)
    other = tuple(block_hashes(list(range(100, 100 + TOKENS)), TOKENS))
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        os.unlink(a._store._l2.path(CHAIN[1]))
        load = LoadSpec("a", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        _layers(b, b_caches)
        shared = SaveSpec("b", CHAIN[2:], PARENTS[2:], (4,), 2, 2, loaded_before=frozenset({1, 2}))
        own = SaveSpec("c", other, (root_hash(),), (6,), 0, 0)
        save_step(b, [SaveSpec("a", CHAIN, PARENTS, (1, 2, 3), 0, 0), shared, own])
        assert b.load_errors() == {2, 3}
        assert b._store.flush(30)
        assert [b._store.has_near(h) for h in CHAIN] == [True, False, False]  # L1: b's saves
        assert b._store.has_near(other[0])
    finally:
        close_replica(a)
        close_replica(b)


def test_steps_scheduled_before_vllm_saw_a_failed_load_save_nothing_computed_from_it(
    tmp_path: Path,
) -> None:
    """Asynchronous scheduling (CUDA's default: two batches in flight): the step after a
    failed load was scheduled before vLLM saw the failure and computed on the stale block, so
    its saves are dropped; the step after that recomputes the block and saves it."""
    a, _ = replica(tmp_path)
    b, b_caches = replica(tmp_path, batches_in_flight=2)
    try:
        save_blocks(a, "computed", (7, 8, 9), blocks=2)
        assert a._store.flush(30)
        os.unlink(a._store._l2.path(CHAIN[1]))
        load = LoadSpec("a", CHAIN[:2], (1, 2), 0, (Tier.L2,) * 2, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        _layers(b, b_caches)
        save_step(b, [SaveSpec("a", CHAIN[:2], PARENTS[:2], (1, 2), 0, 0)])
        assert b.load_errors() == {2}
        ahead = SaveSpec("a", CHAIN[2:], PARENTS[2:], (3,), 2, 2, loaded_before=frozenset({1, 2}))
        save_step(b, [ahead])  # scheduled before the failure was seen: computed from block 1
        assert [b._store.has_near(h) for h in CHAIN] == [True, False, False]
        for name in b_caches:  # vLLM goes back to block 1 and recomputes it and block 2
            b_caches[name][2:4] = 0.5
        save_step(b, [SaveSpec("a", CHAIN[1:], PARENTS[1:], (2, 3), 1, 1)])
        assert all(b._store.has_near(h) for h in CHAIN)
    finally:
        close_replica(a)
        close_replica(b)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_load_past_its_deadline_keeps_what_it_wrote_and_writes_nothing_late(
    tmp_path: Path, asynchronous: bool
) -> None:
    """An L2 whose reads hang (a stalled mount) past the first block: the load is settled at
    its deadline, the hung blocks are recomputed, and the late reads never touch the cache."""
    a, a_caches = replica(tmp_path)
    b, b_caches = replica(tmp_path, load_deadline_s=2.0, load_read_threads=2, load_layerwise=False)
    release = threading.Event()
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        read = b._store._l2_read_into

        def hanging_read(block_hash: bytes, staging: memoryview, times: object) -> object:
            if block_hash != CHAIN[0]:
                release.wait(30)
            return read(block_hash, staging, times)  # type: ignore[arg-type]

        b._store._l2_read_into = hanging_read  # type: ignore[method-assign,assignment]
        before = {n: t[2:4].clone() for n, t in b_caches.items()}
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=asynchronous)
        started = time.monotonic()
        b.start_loads(KvtierMetadata(loads=[load]))
        deadline = started + 20
        while not asynchronous or (b.finished(set())[1] or set()) != {"hit"}:
            assert time.monotonic() < deadline, "the load was never settled"
            if not asynchronous:
                break
            time.sleep(0.05)
        assert time.monotonic() - started < 20  # the hung reads were not waited for
        assert b.load_errors() == {2, 3}
        assert b._counters.totals()["load_deadline_missed"] == 1
        release.set()  # the hung reads complete now, after the deadline
        b._loader.shutdown(wait=True)
        for name in a_caches:
            assert torch.equal(b_caches[name][1], a_caches[name][7])  # written in time: kept
            assert torch.equal(b_caches[name][2:4], before[name])  # late: never written
        assert b.load_errors() == set()  # reported once
    finally:
        release.set()
        close_replica(a)
        close_replica(b)


def test_close_gives_up_on_a_load_stuck_in_a_hung_mount(tmp_path: Path) -> None:
    """vLLM shutting down while an asynchronous load is stuck in an L2 read that never returns:
    `close` returns after its bound instead of waiting for the read."""
    a, _ = replica(tmp_path)
    b, _ = replica(tmp_path, load_layerwise=False)
    release = threading.Event()
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        entered = threading.Event()

        def hung_read(block_hash: bytes, staging: memoryview, times: object) -> object:
            entered.set()
            release.wait(30)
            raise OSError("the mount came back too late")

        b._store._l2_read_into = hung_read  # type: ignore[method-assign,assignment]
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=True)
        b.start_loads(KvtierMetadata(loads=[load]))
        assert entered.wait(10)
        started = time.monotonic()
        b.close()  # waits `CLOSE_WAIT_S` at most
        assert time.monotonic() - started < 15
    finally:
        release.set()
        close_replica(a)
        close_replica(b)


def test_an_l1_hit_is_copied_layer_by_layer_while_the_forward_pass_runs(tmp_path: Path) -> None:
    """A synchronous L1 hit returns from `start_loads` before any copy; the forward pass's
    wait for layer i returns once layer i (and not yet i + 1) of every block is written."""
    a, caches = replica(tmp_path)
    names = list(caches)
    gates = [threading.Event() for _ in names]
    scatter_layer = a._require_kv().scatter_layer

    def gated(layer: int, pending: object) -> None:
        assert gates[layer].wait(30)
        scatter_layer(layer, pending)  # type: ignore[arg-type]

    a._require_kv().scatter_layer = gated  # type: ignore[method-assign]
    try:
        save_blocks(a, "computed", (7, 8, 9))
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L1,) * 3, asynchronous=False)
        a.start_loads(KvtierMetadata(loads=[load]))  # returns: nothing copied yet
        for name in names:
            assert not torch.equal(caches[name][1:4], caches[name][7:10])
        for layer, name in enumerate(names):
            gates[layer].set()
            a.wait_for_layer(name)
            assert torch.equal(caches[name][1:4], caches[name][7:10])
            if layer + 1 < len(names):
                after = names[layer + 1]
                assert not torch.equal(caches[after][1:4], caches[after][7:10])
        a.submit_saves(KvtierMetadata())
        totals = a._counters.totals()
        assert totals["load_blocks_l1"] == 3 and totals["layered_copy_seconds"] > 0
        assert totals.get("phase_copy_seconds", 0) == 0  # nothing copied before the forward
        assert a.load_errors() == set()
    finally:
        for gate in gates:
            gate.set()
        close_replica(a)


def test_the_layered_copy_is_on_by_default_only_with_a_core_of_its_own(tmp_path: Path) -> None:
    """Unset, `load_layerwise` follows the placement: on when the background threads have a
    core the engine (this thread) is not bound to, off when they stay on the engine's."""
    config = ConnectorSettings(l1_bytes=1 << 20)
    identity = model_identity(config, geometry(), "model", 0)
    shared = ProcessStore(
        identity.namespace(), TieredStore(config.store_settings(), identity), HashAliases(), None
    )
    found: dict[str, bool] = {}

    def engine_thread() -> None:
        os.sched_setaffinity(0, {0})  # bound like vLLM's worker
        for name, cpus in (("own core", {1}), ("engine's core", {0}), ("inherit", None)):
            side = WorkerSide(shared, geometry(), 0, TOKENS, 1, ConnectorCounters(), cpus=cpus)
            found[name] = side._layerwise
            side.close()

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert found == {"own core": True, "engine's core": False, "inherit": False}
    shared.store.close()


def test_a_layered_copy_the_forward_pass_did_not_wait_for_is_recomputed(tmp_path: Path) -> None:
    """A forward pass that skipped `wait_for_layer_load` may have read blocks not yet written:
    they are reported failed (vLLM drops the step's output and recomputes them), and later
    hits are copied before the forward."""
    a, caches = replica(tmp_path)
    try:
        save_blocks(a, "computed", (7, 8, 9))
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L1,) * 3, asynchronous=False)
        a.start_loads(KvtierMetadata(loads=[load]))
        a.wait_for_layer(next(iter(caches)))  # layer 0 only
        a.submit_saves(KvtierMetadata())
        assert a.load_errors() == {1, 2, 3}
        load = LoadSpec("again", CHAIN, (4, 5, 6), 0, (Tier.L1,) * 3, asynchronous=False)
        a.start_loads(KvtierMetadata(loads=[load]))  # copied before returning now
        for name in caches:
            assert torch.equal(caches[name][4:7], caches[name][7:10])
        assert a.load_errors() == set()
    finally:
        close_replica(a)


def test_a_layered_copy_that_fails_reports_its_blocks_and_never_hangs_the_forward(
    tmp_path: Path,
) -> None:
    a, caches = replica(tmp_path)

    def broken(layer: int, pending: object) -> None:
        raise MemoryError("copy failed")

    try:
        save_blocks(a, "computed", (7, 8, 9))
        a._require_kv().scatter_layer = broken  # type: ignore[method-assign]
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L1,) * 3, asynchronous=False)
        a.start_loads(KvtierMetadata(loads=[load]))
        for name in caches:
            a.wait_for_layer(name)
        assert a.load_errors() == {1, 2, 3}
        save_blocks(a, "hit", (1, 2, 3))  # this step's save skips the blocks never written
        assert a._counters.totals()["save_skipped_blocks"] == 0
    finally:
        close_replica(a)


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_hit_from_l1_and_l2_lands_byte_for_byte_either_way(
    tmp_path: Path, layerwise: bool
) -> None:
    """An L1 hit and L2 hits (read in pieces from a local directory) through the layered copy,
    or copied before the forward pass."""
    a, a_caches = replica(tmp_path)
    b, b_caches = replica(tmp_path, load_layerwise=layerwise, load_read_threads=2)
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        load = LoadSpec("first", CHAIN[:1], (4,), 0, (Tier.L2,), asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        _layers(b, b_caches)
        save_blocks(b, "first", (4,), promote=frozenset({0}))  # block 0 reaches b's L1
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L1,) + (Tier.L2,) * 2, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        _forward(b, b_caches)
        assert b.load_errors() == set()
        for name in a_caches:
            assert torch.equal(b_caches[name][1:4], a_caches[name][7:10])
        totals = b._counters.totals()
        assert totals["load_blocks_l1"] == 1 and totals["load_blocks_l2"] == 3
        assert (totals.get("layered_copy_seconds", 0) > 0) == layerwise
        assert (totals["phase_copy_seconds"] > 0) != layerwise  # the copy before the forward
    finally:
        close_replica(a)
        close_replica(b)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "header"])
def test_a_bad_l2_block_read_beside_the_forward_is_reported_and_removed(
    tmp_path: Path, damage: str
) -> None:
    """An L2 block read layer by layer is verified as its first piece brings its header and
    once every layer is in: a header or payload that fails its checksum (or a read cut short)
    is a failed load, recomputed, and a corrupt file is removed; the blocks before it
    stand."""
    a, a_caches = replica(tmp_path)
    b, b_caches = replica(tmp_path)
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        path = Path(a._store._l2.path(CHAIN[1]))
        open_block = b._store._l2.open_block

        def damaged(block_hash: bytes, payload_bytes: int) -> object:
            opened = open_block(block_hash, payload_bytes)
            if block_hash == CHAIN[1]:
                with path.open("r+b") as f:  # after the file was opened
                    if damage == "header":
                        f.write(b"XXXX")
                    elif damage == "corrupt":
                        f.seek(-1, os.SEEK_END)
                        last = f.read(1)
                        f.seek(-1, os.SEEK_END)
                        f.write(bytes([last[0] ^ 0xFF]))
                    else:
                        f.truncate(path.stat().st_size - 1)
            return opened

        b._store._l2.open_block = damaged
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        b.start_loads(KvtierMetadata(loads=[load]))
        _layers(b, b_caches)
        assert b.load_errors() == {2}
        for name in a_caches:
            assert torch.equal(b_caches[name][1], a_caches[name][7])
            assert torch.equal(b_caches[name][3], a_caches[name][9])
        assert path.exists() == (damage == "truncated")  # a short read may be transient
        assert b._counters.totals()["layered_copy_seconds"] > 0
    finally:
        close_replica(a)
        close_replica(b)


def test_a_layered_read_past_the_deadline_is_settled_and_writes_nothing_late(
    tmp_path: Path,
) -> None:
    """A read that hangs beside the forward pass (a stalled disk): the forward's wait gives up
    at the load deadline, every block not complete is recomputed, and the late read never
    writes into the cache."""
    a, a_caches = replica(tmp_path)
    b, b_caches = replica(tmp_path, load_deadline_s=1.0)
    release = threading.Event()
    try:
        save_blocks(a, "computed", (7, 8, 9))
        assert a._store.flush(30)
        open_block = b._store._l2.open_block

        def hanging(block_hash: bytes, payload_bytes: int) -> object:
            opened = open_block(block_hash, payload_bytes)
            if opened is not None and block_hash == CHAIN[2]:
                read_at = opened.read_at

                def slow(offset: int, out: memoryview) -> None:
                    release.wait(30)
                    read_at(offset, out)

                opened.read_at = slow
            return opened

        b._store._l2.open_block = hanging
        before = {n: t[3].clone() for n, t in b_caches.items()}
        load = LoadSpec("hit", CHAIN, (1, 2, 3), 0, (Tier.L2,) * 3, asynchronous=False)
        started = time.monotonic()
        b.start_loads(KvtierMetadata(loads=[load]))
        _layers(b, b_caches)
        assert time.monotonic() - started < 10
        assert b.load_errors() == {1, 2, 3}  # none complete: all recomputed
        assert b._counters.totals()["load_deadline_missed"] == 1
        release.set()
        b._copier.shutdown(wait=True)
        for name in b_caches:
            assert torch.equal(b_caches[name][3], before[name])  # never written
        assert b.load_errors() == set()
    finally:
        release.set()
        close_replica(a)
        close_replica(b)


def test_saves_beyond_the_backlog_are_dropped_and_never_hold_the_request(tmp_path: Path) -> None:
    a, _ = replica(tmp_path, save_backlog_blocks=2)
    try:
        spec = SaveSpec("big", CHAIN, PARENTS, (7, 8, 9), first_index=0, reused_blocks=0)
        a.submit_saves(KvtierMetadata(saves=[spec]))
        assert a._counters.totals()["save_dropped_blocks"] == 3
        # reported finished at once, or vLLM, which holds its blocks for the save, never frees them
        assert a.finished({"big"}) == ({"big"}, None)
        assert a.finished(set()) == (None, None)  # once
        assert not any(a._store.has_near(h) for h in CHAIN)
    finally:
        close_replica(a)


def test_saves_charge_the_backlog_only_with_blocks_l1_lacks(tmp_path: Path) -> None:
    """A save whose leading blocks L1 holds (a request's hits) is charged, and if need be
    dropped and counted, for the blocks it has to copy out only."""
    a, _ = replica(tmp_path, save_backlog_blocks=1)
    try:
        save_blocks(a, "first", (7,), blocks=1)
        spec = SaveSpec("big", CHAIN, PARENTS, (7, 8, 9), first_index=0, reused_blocks=0)
        a.submit_saves(KvtierMetadata(saves=[spec]))  # 2 to copy, past the backlog
        assert a.finished({"big"}) == ({"big"}, None)
        assert a._counters.totals()["save_dropped_blocks"] == 2
        save_blocks(a, "second", (7, 8), blocks=2)  # 1 to copy: within the backlog
        assert a._counters.totals()["save_dropped_blocks"] == 2
        assert [a._store.has_near(h) for h in CHAIN] == [True, True, False]
        assert a._counters.totals()["save_skipped_blocks"] == 1
    finally:
        close_replica(a)


def test_a_stalled_l2_never_holds_a_finished_requests_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2 existence checks that never return (a stalled mount): saves still finish, so vLLM
    frees the finished requests' blocks; the saver never asks L2."""
    a, _ = replica(tmp_path)
    stall = threading.Event()

    def hung(*args: object) -> object:
        stall.wait(30)
        raise OSError("stalled")

    l2 = a._store._l2
    monkeypatch.setattr(l2, "contains", hung)
    monkeypatch.setattr(l2, "contains_many", hung)
    try:
        save_blocks(a, "r1", (7, 8, 9), timeout_s=5)
        save_blocks(a, "r2", (7, 8, 9), timeout_s=5)  # L1 holds them now
        assert a._counters.totals()["save_blocks"] == 3
    finally:
        stall.set()
        close_replica(a)


def test_a_preemption_stops_a_save_without_waiting_for_a_slow_store(tmp_path: Path) -> None:
    """The saver is stuck in a store lookup (a store that answers in seconds): preempting the
    request returns at once, and no block of it is read from the engine afterwards (vLLM hands
    its blocks to other requests)."""
    a, caches = replica(tmp_path)
    entered, release = threading.Event(), threading.Event()
    in_l1 = a._store.in_l1

    def slow_in_l1(block_hash: bytes) -> bool:
        if threading.current_thread().name.startswith("kvtier-save"):
            entered.set()
            release.wait(30)
        return in_l1(block_hash)  # type: ignore[arg-type]

    a._store.in_l1 = slow_in_l1  # type: ignore[method-assign]
    try:
        spec = SaveSpec("slow", CHAIN, PARENTS, (7, 8, 9), first_index=0, reused_blocks=0)
        a.submit_saves(KvtierMetadata(saves=[spec]))
        assert entered.wait(10)
        started = time.monotonic()
        a.handle_preemptions(KvtierMetadata(preempted=frozenset({"slow"})))
        assert time.monotonic() - started < 1.0  # did not wait for the store
        for name in caches:
            caches[name][7:10] = 0.25  # vLLM reuses the blocks at once
        release.set()
        a._saver.shutdown(wait=True)
        assert a._counters.totals()["save_dropped_blocks"] == 3
        assert a._counters.totals()["save_blocks"] == 0
        assert not any(a._store.has_near(h) for h in CHAIN)
    finally:
        release.set()
        close_replica(a)


class RanksUnion:
    """Two ranks' `ranks_union` for one step: each waits for the other's set, as vLLM's
    all-gather over the TP group does."""

    def __init__(self) -> None:
        self._sets: list[set[int]] = []
        self._lock = threading.Lock()
        self._both = threading.Barrier(2, timeout=30)

    def __call__(self, mine: set[int]) -> set[int]:
        with self._lock:
            self._sets.append(mine)
        self._both.wait()
        return set().union(*self._sets)


def test_with_tensor_parallelism_one_ranks_failed_load_bars_every_ranks_saves(
    tmp_path: Path,
) -> None:
    """TP=2, one step loads blocks 0-1 and computes block 2; rank 1 fails to load block 1 (its
    L1 or L2 lost it). Rank 1's attention then reads stale KV, and its output is all-reduced
    into every rank's: rank 0's block 2 is wrong too, though its own loads succeeded. Neither
    rank saves it (before, rank 0 did, and its later recompute found the block held)."""
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    union = RanksUnion()
    sides = []
    for d in dirs:
        d.mkdir()
        writer, _ = replica(d)
        save_blocks(writer, "w", (7, 8), blocks=2)
        assert writer._store.flush(30)
        close_replica(writer)
        sides.append(replica(d, ranks_union=union))
    (r0, c0), (r1, c1) = sides
    try:
        os.unlink(r1._store._l2.path(CHAIN[1]))  # rank 1 lost block 1
        load = LoadSpec("a", CHAIN[:2], (1, 2), 0, (Tier.L2,) * 2, asynchronous=False)
        save = SaveSpec("a", CHAIN, PARENTS, (1, 2, 3), 0, 0)

        def step(side: WorkerSide, caches: dict[str, torch.Tensor]) -> None:
            side.start_loads(KvtierMetadata(loads=[load]))
            for name in caches:
                side.wait_for_layer(name)
            side.submit_saves(KvtierMetadata(loads=[load], saves=[save]))

        rank1 = threading.Thread(target=step, args=(r1, c1))
        rank1.start()
        step(r0, c0)
        rank1.join(30)
        assert r0.load_errors() == set() and r1.load_errors() == {2}
        r0._saver.shutdown(wait=True)
        assert not r0._store.has_near(CHAIN[2])  # computed from rank 1's stale block 1
        assert r0._store.has_near(CHAIN[0])  # computed before it: saved
    finally:
        close_replica(r0)
        close_replica(r1)


def test_a_preempted_request_is_never_reported_for_saves_it_no_longer_has(
    tmp_path: Path,
) -> None:
    """A request preempted with saves, resumed with an asynchronous load and aborted during it
    is reported once, when its load settles: not also as finished sending for the dropped saves
    (vLLM frees a request at its first report and asserts it still exists at the second, and
    the first would free blocks the load is still writing)."""
    writer, _ = replica(tmp_path)
    side, _ = replica(tmp_path)
    try:
        save_blocks(writer, "w", (7, 8, 9))
        assert writer._store.flush(30)
        side.submit_saves(KvtierMetadata(saves=[SaveSpec("r", CHAIN[:1], PARENTS[:1], (1,), 0, 0)]))
        side.handle_preemptions(KvtierMetadata(preempted=frozenset({"r"})))
        side.submit_saves(KvtierMetadata(preempted=frozenset({"r"})))
        load = LoadSpec("r", CHAIN, (4, 5, 6), 0, (Tier.L2,) * 3)  # resumed: an async hit
        side.start_loads(KvtierMetadata(loads=[load]))
        reports = [side.finished({"r"})]  # aborted by the client
        deadline = time.monotonic() + 30
        while not any("r" in (recving or ()) for _, recving in reports):
            assert time.monotonic() < deadline, reports
            time.sleep(0.01)
            reports.append(side.finished(set()))
        assert not any("r" in (sending or ()) for sending, _ in reports)
    finally:
        close_replica(writer)
        close_replica(side)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_background_threads_leave_the_cpus_the_engine_is_bound_to() -> None:
    cpus = os.cpu_count() or 1
    seen: dict[str, object] = {}

    def engine_thread() -> None:
        os.sched_setaffinity(0, {cpus - 1})  # as vLLM binds its worker
        seen["background"] = background_cpus(None)
        seen["inherit"] = background_cpus("inherit")
        seen["explicit"] = background_cpus("0")
        helper = threading.Thread(target=probe, args=(thread_placer({0}),))
        helper.start()
        helper.join()

    def probe(place: Callable[[], None] | None) -> None:
        assert place is not None
        place()
        seen["placed"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen["background"] == set(range(cpus - 1))
    assert seen["inherit"] is None and seen["explicit"] == {0}
    assert seen["placed"] == {0}
    assert thread_placer(None) is None
