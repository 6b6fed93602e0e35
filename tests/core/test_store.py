"""TieredStore over a real L1 and a real L2 directory (a gated test double only for the queue)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.core.codec import BlockMeta
from kvtier.core.errors import CodecError, ConfigError
from kvtier.core.events import EventKind
from kvtier.core.keys import BlockHash, ModelIdentity, block_hashes, root_hash
from kvtier.core.settings import StoreSettings
from kvtier.core.store import TieredStore
from kvtier.core.tiers.base import PutResult, StoredBlock, Tier, TierStats
from kvtier.core.tiers.posix import PosixTier
from tests.helpers.tiers import payload_for

IDENTITY = ModelIdentity(model="store-test", block_tokens=4)
NBYTES = 4096
CHAIN = block_hashes(list(range(40)), 4)  # 10 chained blocks
L1_BLOCKS = 4
Event = tuple[EventKind, Tier, tuple[BlockHash, ...]]


def meta(i: int) -> BlockMeta:
    return BlockMeta(
        num_tokens=4, dtype="uint8", shape=(NBYTES,), parent=CHAIN[i - 1] if i else root_hash()
    )


def payload(i: int) -> bytes:
    return payload_for(CHAIN[i], NBYTES)


def config(tmp_path: Path | None, **kw: object) -> StoreSettings:
    values: dict[str, object] = {
        "l1_bytes": L1_BLOCKS * NBYTES,
        "l2_path": None if tmp_path is None else str(tmp_path),
    } | kw
    return StoreSettings(**values)


def save_chain(store: TieredStore, n: int) -> None:
    for i in range(n):
        assert store.save(CHAIN[i], meta(i), payload(i))


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def __call__(self, kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            self.events.append((kind, tier, tuple(hashes)))

    def of(self, tier: Tier) -> list[tuple[EventKind, tuple[BlockHash, ...]]]:
        return [(k, h) for k, t, h in self.events if t == tier]


class GatedTier:
    """L2 double whose writes wait on a gate: isolates the write queue from any real I/O."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.written: list[BlockHash] = []

    @property
    def tier(self) -> Tier:
        return Tier.L2

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.written

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return [self.contains(h) for h in hashes]

    def get(self, block_hash: BlockHash) -> StoredBlock | None:
        return None

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        return [None] * len(hashes)

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: object) -> PutResult:
        self.entered.set()
        assert self.gate.wait(60), "test never opened the gate"
        self.written.append(block_hash)
        return PutResult(stored=True)

    def remove(self, block_hash: BlockHash) -> bool:
        return False

    def stats(self) -> TierStats:
        return TierStats()

    def close(self) -> None:
        pass


class FailingTier(GatedTier):
    """L2 double that breaks its contract by raising from every call."""

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        raise OSError("mount gone")

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        raise RuntimeError("bug in a backend")

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: object) -> PutResult:
        raise OSError("mount gone")


# ---- lookup and load -------------------------------------------------------------------------


def test_lookup_finds_longest_contiguous_prefix_across_tiers(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path), IDENTITY) as store:
        save_chain(store, 6)
        assert store.flush(60)
        # L1 holds 4 blocks: block 4 was refused (its 4 ancestors fill L1), and so was block
        # 5 (its parent refused): the head stays in L1. Both reached L2.
        assert store.lookup(CHAIN) == [Tier.L1] * 4 + [Tier.L2] * 2
        PosixTier(str(tmp_path), IDENTITY.namespace(), {}).remove(CHAIN[4])
    with TieredStore(config(tmp_path, l2_exists_ttl_s=0), IDENTITY) as store:
        assert store.lookup(CHAIN) == [Tier.L2] * 4
        assert store.lookup(CHAIN[4:]) == []  # a prefix ends at its first missing block
        assert store.lookup(CHAIN[5:]) == [Tier.L2]
        stats = store.stats()
        assert (stats.lookups, stats.lookup_blocks, stats.lookup_hit_blocks) == (3, 21, 5)


def test_lookup_has_no_side_effects(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path), IDENTITY) as store:
        save_chain(store, 3)
        store.flush(60)
        before = store.stats()
        assert store.lookup(CHAIN) == [Tier.L1] * 3
        after = store.stats()
        assert (after.l1, after.l2) == (before.l1, before.l2)


def test_load_promotes_l2_hits_into_l1(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path), IDENTITY) as writer:
        save_chain(writer, 3)
        assert writer.flush(60)
    events = Recorder()
    with TieredStore(config(tmp_path), IDENTITY, on_event=events) as reader:
        assert reader.lookup(CHAIN) == [Tier.L2] * 3
        loaded = reader.load(CHAIN)
        assert [b.tier for b in loaded] == [Tier.L2] * 3
        assert [bytes(b.payload) for b in loaded] == [payload(i) for i in range(3)]
        assert [b.meta for b in loaded] == [meta(i) for i in range(3)]
        assert [b.block_hash for b in loaded] == CHAIN[:3]
        assert events.of(Tier.L1) == [(EventKind.STORED, (CHAIN[i],)) for i in range(3)]
        assert reader.lookup(CHAIN) == [Tier.L1] * 3
        assert [b.tier for b in reader.load(CHAIN)] == [Tier.L1] * 3
        stats = reader.stats()
        assert stats.l2 is not None and stats.l1 is not None
        assert (stats.l2.hits, stats.l1.hits) == (3, 3)


def test_load_stops_at_a_corrupt_block_and_removes_it(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path), IDENTITY) as writer:
        save_chain(writer, 3)
        assert writer.flush(60)
    path = Path(PosixTier(str(tmp_path), IDENTITY.namespace(), {}).path(CHAIN[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with TieredStore(config(tmp_path), IDENTITY) as reader:
        assert [b.block_hash for b in reader.load(CHAIN)] == [CHAIN[0]]
        assert not path.exists()
        stats = reader.stats()
        assert stats.l2 is not None and stats.l2.corrupt_removed == 1


def test_l1_only_store_keeps_the_head_of_a_chain_longer_than_l1() -> None:
    events = Recorder()
    with TieredStore(config(None), IDENTITY, on_event=events) as store:
        save_chain(store, 5)
        assert store.lookup(CHAIN) == [Tier.L1] * 4
        assert store.contains(CHAIN[4]) is None
        assert events.of(Tier.L1) == [(EventKind.STORED, (CHAIN[i],)) for i in range(4)]
        assert [bytes(b.payload) for b in store.load(CHAIN)] == [payload(i) for i in range(4)]
        stats = store.stats()
        assert stats.l1 is not None and (stats.l1.stored, stats.l1.rejected) == (4, 1)


@pytest.mark.parametrize("l1_bytes", [L1_BLOCKS * NBYTES, 0])
def test_saved_payload_is_copied_before_save_returns(tmp_path: Path, l1_bytes: int) -> None:
    buffer = bytearray(payload(0))
    with TieredStore(config(tmp_path, l1_bytes=l1_bytes), IDENTITY) as store:
        store.save(CHAIN[0], meta(0), buffer)
        buffer[:] = bytes(NBYTES)
        assert store.flush(60)
        (block,) = store.load(CHAIN[:1])
        assert bytes(block.payload) == payload(0)


def test_payload_contradicting_its_meta_is_a_caller_error() -> None:
    with TieredStore(config(None), IDENTITY) as store:
        bad = BlockMeta(num_tokens=4, dtype="bfloat16", shape=(NBYTES,), parent=root_hash())
        with pytest.raises(CodecError, match="payload"):
            store.save(CHAIN[0], bad, payload(0))


# ---- admission -------------------------------------------------------------------------------


def test_unknown_admission_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="admission"):
        TieredStore(config(None, admission="lfu"), IDENTITY)


def test_min_tokens_admits_only_long_enough_prefixes(tmp_path: Path) -> None:
    with TieredStore(
        config(tmp_path, admission="min-tokens", admission_min_tokens=8), IDENTITY
    ) as store:
        assert not store.save(CHAIN[0], meta(0), payload(0), prefix_tokens=4)
        assert store.save(CHAIN[1], meta(1), payload(1), prefix_tokens=8)
        assert not store.save(CHAIN[2], meta(2), payload(2))  # defaults to the block's 4 tokens
        assert store.flush(60)
        assert [store.contains(h) for h in CHAIN[:3]] == [None, Tier.L1, None]
        stats = store.stats()
        assert (stats.saves, stats.admission_rejected, stats.l2_queued) == (3, 2, 1)
        assert stats.l2 is not None and stats.l2.stored == 1


def test_reused_admits_on_second_save_or_when_told(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path, admission="reused"), IDENTITY) as store:
        assert not store.save(CHAIN[0], meta(0), payload(0))
        assert store.contains(CHAIN[0]) is None
        assert store.save(CHAIN[0], meta(0), payload(0))
        assert store.save(CHAIN[1], meta(1), payload(1), reused=True)
        assert store.flush(60)
        assert store.lookup(CHAIN) == [Tier.L1, Tier.L1]


# ---- write-through queue -------------------------------------------------------------------


def test_full_queue_drops_and_counts_without_blocking_save() -> None:
    l2 = GatedTier()
    store = TieredStore(config(None, write_queue_blocks=2, io_threads=1), IDENTITY, l2_tier=l2)
    try:
        assert store.save(CHAIN[0], meta(0), payload(0))
        assert l2.entered.wait(60)  # the writer holds block 0; the queue is empty again
        for i in range(1, 6):  # 1 and 2 fill the queue; 3, 4, 5 are dropped at once
            assert store.save(CHAIN[i], meta(i), payload(i))
        stats = store.stats()
        assert (stats.l2_queued, stats.l2_dropped, stats.l2_queue_depth) == (3, 3, 3)
        assert store.contains(CHAIN[3]) == Tier.L1  # a dropped block was kept in L1
        l2.gate.set()
        assert store.flush(60)
        assert l2.written == CHAIN[:3]
        assert store.stats().l2_queue_depth == 0
    finally:
        l2.gate.set()
        store.close()


def test_a_block_already_queued_is_not_queued_twice() -> None:
    l2 = GatedTier()
    with TieredStore(config(None, io_threads=1), IDENTITY, l2_tier=l2) as store:
        store.save(CHAIN[0], meta(0), payload(0))
        assert l2.entered.wait(60)
        store.save(CHAIN[0], meta(0), payload(0))
        store.save(CHAIN[1], meta(1), payload(1))
        store.save(CHAIN[1], meta(1), payload(1))
        l2.gate.set()
        assert store.flush(60)
        assert l2.written == CHAIN[:2]
        assert store.stats().l2_queued == 2


def test_close_with_drain_writes_everything_queued(tmp_path: Path) -> None:
    events = Recorder()
    store = TieredStore(config(tmp_path, l1_bytes=0), IDENTITY, on_event=events)
    save_chain(store, 5)
    store.close(drain=True)
    assert sorted(h for _, (h,) in events.of(Tier.L2)) == sorted(CHAIN[:5])
    stats = store.stats()
    assert (stats.l2_abandoned, stats.l2_queue_depth) == (0, 0)
    assert stats.l2 is not None and stats.l2.stored == 5
    assert not store.save(CHAIN[6], meta(6), payload(6))  # closed


def test_close_without_drain_abandons_queued_writes() -> None:
    l2 = GatedTier()
    store = TieredStore(config(None, io_threads=1), IDENTITY, l2_tier=l2)
    store.save(CHAIN[0], meta(0), payload(0))
    assert l2.entered.wait(60)
    for i in range(1, 4):
        store.save(CHAIN[i], meta(i), payload(i))
    closer = threading.Thread(target=store.close, kwargs={"drain": False})
    closer.start()
    for _ in range(6000):  # bounded wait for close() to discard the queue
        if store.stats().l2_abandoned == 3:
            break
        closer.join(0.01)
    l2.gate.set()  # now let the write in progress finish
    closer.join(60)
    assert not closer.is_alive()
    assert l2.written == [CHAIN[0]]
    stats = store.stats()
    assert (stats.l2_queued, stats.l2_abandoned, stats.l2_queue_depth) == (4, 3, 0)


def test_a_save_racing_close_is_counted_and_leaves_nothing_queued(tmp_path: Path) -> None:
    """A save that passed the closed check before `close` began offers its L2 write after the
    writers stopped: it is refused and counted, not left queued forever (depth stuck above
    zero, `flush` never true again)."""
    store: TieredStore | None = None

    def close_midway(kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        # L1 announces block 1 between save()'s closed check and its L2 offer: the owner's
        # close lands exactly there.
        if tier == Tier.L1 and kind == EventKind.STORED and hashes[0] == CHAIN[1]:
            assert store is not None
            store.close()

    store = TieredStore(config(tmp_path), IDENTITY, on_event=close_midway)
    assert store.save(CHAIN[0], meta(0), payload(0))
    assert store.save(CHAIN[1], meta(1), payload(1))  # admitted: it is in L1
    assert store.flush(0)
    stats = store.stats()
    assert (stats.l2_queued, stats.l2_dropped, stats.l2_queue_depth) == (1, 1, 0)
    assert stats.l2 is not None and stats.l2.stored == 1
    assert store.contains(CHAIN[1]) == Tier.L1


def test_l2_write_skipped_when_another_replica_already_wrote_it(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path), IDENTITY) as first:
        save_chain(first, 2)
    with TieredStore(config(tmp_path), IDENTITY) as second:
        save_chain(second, 2)
        assert second.flush(60)
        stats = second.stats()
        assert stats.l2 is not None
        assert (stats.l2.stored, stats.l2.already_present) == (0, 2)


def test_resaving_a_block_recently_confirmed_in_l2_skips_the_write_through(tmp_path: Path) -> None:
    now = [100.0]
    with TieredStore(
        config(tmp_path, l2_exists_ttl_s=5.0), IDENTITY, clock=lambda: now[0]
    ) as store:
        save_chain(store, 1)
        assert store.flush(60)
        save_chain(store, 1)
        assert store.stats().l2_queued == 1
        now[0] += 5.0  # the confirmation expired: the writer checks L2 again
        save_chain(store, 1)
        assert store.flush(60)
        stats = store.stats()
        assert stats.l2_queued == 2
        assert stats.l2 is not None and (stats.l2.stored, stats.l2.already_present) == (1, 1)


def test_concurrent_callers_see_only_whole_correct_blocks(tmp_path: Path) -> None:
    """Four threads save, look up and load the same chain through one small store."""
    errors: list[str] = []
    with TieredStore(
        config(tmp_path, l1_bytes=3 * NBYTES, write_queue_blocks=4), IDENTITY
    ) as store:

        def worker(seed: int) -> None:
            for step in range(300):
                i = (seed * 7 + step) % len(CHAIN)
                store.save(CHAIN[i], meta(i), payload(i))
                tiers = store.lookup(CHAIN)
                for j, block in enumerate(store.load(CHAIN[: len(tiers)])):
                    if bytes(block.payload) != payload(j) or block.meta != meta(j):
                        errors.append(f"thread {seed} step {step}: block {j} differs")
                stats = store.stats().l1
                if stats is not None and stats.used_bytes > 3 * NBYTES:
                    errors.append(f"L1 over budget: {stats.used_bytes}")

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert store.flush(60)
        assert errors == []
        for i in range(len(CHAIN)):  # one at a time, so none is dropped: then all are in L2
            store.save(CHAIN[i], meta(i), payload(i))
            assert store.flush(60)
        assert [bytes(b.payload) for b in store.load(CHAIN)] == [payload(i) for i in range(10)]


# ---- degradation ---------------------------------------------------------------------------


def _immutable_dir(tmp_path: Path) -> Path:
    """A directory even root cannot write into (`chattr +i`); skips where that is unavailable."""
    path = tmp_path / "immutable"
    path.mkdir()
    chattr = shutil.which("chattr")
    if (
        chattr is None
        or subprocess.run([chattr, "+i", str(path)], check=False, capture_output=True).returncode
        != 0
    ):
        pytest.skip("chattr +i is not available on this file system")
    return path


@pytest.mark.parametrize("where", ["missing", "below-a-file", "immutable"])
def test_unusable_l2_directory_degrades_to_l1_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    (tmp_path / "file").write_bytes(b"")
    path = {
        "missing": lambda: tmp_path / "missing",
        "below-a-file": lambda: tmp_path / "file/l2",
        "immutable": lambda: _immutable_dir(tmp_path),
    }[where]()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.core.store"):
            store = TieredStore(config(path), IDENTITY)
    finally:
        if where == "immutable":
            subprocess.run(["chattr", "-i", str(path)], check=True)
    with store:
        assert "L2 disabled, running L1-only" in caplog.text
        assert not store.l2_enabled
        save_chain(store, 2)
        assert store.flush(60)
        assert [b.tier for b in store.load(CHAIN)] == [Tier.L1, Tier.L1]
        stats = store.stats()
        assert stats.l2 is None and stats.l2_disabled_reason is not None
    assert not (tmp_path / "missing").exists()


def test_misbehaving_l2_never_reaches_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    l2 = FailingTier()
    with (
        caplog.at_level(logging.ERROR, logger="kvtier.core.store"),
        TieredStore(config(None, l1_bytes=0), IDENTITY, l2_tier=l2) as store,
    ):
        assert store.save(CHAIN[0], meta(0), payload(0))
        assert store.flush(60)
        assert store.lookup(CHAIN) == []
        assert store.load(CHAIN) == []
        assert store.stats().l2_write_errors == 1
    assert "treating it as a miss" in caplog.text


class UnconfirmableTier(GatedTier):
    """L2 double that never stores and whose existence check raises."""

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: object) -> PutResult:
        self.written.append(block_hash)
        return PutResult(stored=False)

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        raise OSError("mount gone")


def test_writer_survives_a_tier_raising_after_a_put() -> None:
    l2 = UnconfirmableTier()
    with TieredStore(config(None, io_threads=1), IDENTITY, l2_tier=l2) as store:
        save_chain(store, 3)
        assert store.flush(60)
        assert l2.written == CHAIN[:3]


def test_failing_event_callback_is_counted_not_raised() -> None:
    def explode(kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        raise RuntimeError("subscriber bug")

    with TieredStore(config(None), IDENTITY, on_event=explode) as store:
        assert store.save(CHAIN[0], meta(0), payload(0))
        assert store.stats().event_errors == 1


def test_manifest_is_written_beside_the_blocks(tmp_path: Path) -> None:
    with TieredStore(config(tmp_path), IDENTITY):
        pass
    assert (tmp_path / IDENTITY.namespace() / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"l1_bytes": -1}, "l1_bytes"),
        ({"l2_path": ""}, "l2_path"),
        ({"admission": ""}, "admission"),
        ({"admission_min_tokens": -1}, "admission_min_tokens"),
        ({"write_queue_blocks": 0}, "write_queue_blocks"),
        ({"io_threads": 0}, "io_threads"),
        ({"l2_exists_ttl_s": -1}, "l2_exists_ttl_s"),
        ({"l2_url": "http://127.0.0.1:6379"}, "l2_url"),
        ({"l2_url": "redis://127.0.0.1:6379", "l2_path": "/tmp"}, "l2_url"),
        ({"l2_url": "redis://127.0.0.1:6379", "l2_capacity_bytes": 1}, "l2_capacity_bytes"),
        ({"l2_capacity_bytes": 0}, "l2_capacity_bytes"),
        ({"l2_profile": "zfs"}, "l2_profile"),
        ({"l2_high_watermark": 1.5}, "l2_high_watermark"),
        ({"l2_low_watermark": 0.95}, "l2_low_watermark"),
        ({"l2_low_watermark": 0}, "l2_low_watermark"),
        ({"l2_janitor_interval_s": 0}, "l2_janitor_interval_s"),
        ({"l2_touch_interval_s": -1}, "l2_touch_interval_s"),
    ],
)
def test_config_rejects_invalid_fields(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        StoreSettings(**kwargs)
