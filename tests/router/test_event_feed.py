"""KV events into the kvaware index: kvtier connector events and re-hashed vLLM events."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import BlockHash, block_hashes, extra_key
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import SNAPSHOT_MIN_INTERVAL_S, EventPublisher
from kvtier.router.event_feed import EventFeed, KvtierApplier, VllmRehasher
from kvtier.router.index import SHARED, PrefixIndex

BLOCK = 4
TOKENS = list(range(100, 116))  # 4 blocks
HASHES = tuple(block_hashes(TOKENS, BLOCK))


class Counts:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, source: str, kind: str) -> None:
        self.calls.append((source, kind))


def kv(
    kind: EventKind,
    tier: Tier,
    hashes: tuple = HASHES,
    epoch: str = "e1",
    replica: str = "r1",
    seq: int = 0,
) -> KVEvent:
    return KVEvent(kind, replica, epoch, tier, hashes, seq)


def test_kvtier_events_fill_tiers_and_l2_goes_to_the_shared_pseudo_replica() -> None:
    index = PrefixIndex()
    applier = KvtierApplier(index)
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:2]), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L2), now=0.0)
    assert index.match(HASHES, replicas=["r1", "r2"]) == {
        "r1": [Tier.L1, Tier.L1, Tier.L2, Tier.L2],
        "r2": [Tier.L2] * 4,
    }
    applier.apply(kv(EventKind.REMOVED, Tier.L2, HASHES[2:]), now=1.0)
    applier.apply(kv(EventKind.CLEARED, Tier.L1, ()), now=1.0)
    assert index.match(HASHES, replicas=["r1"]) == {"r1": [Tier.L2, Tier.L2]}


def test_a_new_epoch_purges_the_restarted_replicas_l1_but_not_the_shared_pool() -> None:
    index = PrefixIndex()
    counts = Counts()
    applier = KvtierApplier(index, count=counts)
    applier.apply(kv(EventKind.STORED, Tier.L1), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L2, HASHES[:1]), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], epoch="e2", seq=0), now=1.0)
    assert counts.calls == [("kvtier", "restart")]
    assert index.match(HASHES, replicas=["r1"]) == {"r1": [Tier.L1]}
    assert SHARED in index.replicas()


def test_a_new_epoch_keeps_the_l0_that_vllms_events_announced() -> None:
    index = PrefixIndex()
    applier, rehasher = KvtierApplier(index), VllmRehasher("r1", index)
    rehasher.apply(0, vllm_batch(stored([1, 2], TOKENS[:8])), 0.0, Counts())
    applier.apply(kv(EventKind.STORED, Tier.L1), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], epoch="e2"), now=1.0)
    assert index.match(HASHES) == {"r1": [Tier.L0, Tier.L0]}


def test_a_vllm_restart_keeps_what_the_connectors_new_epoch_already_announced() -> None:
    """One restart, two sources: the connector's new epoch arrives first, the engine's first
    event (its sequence back at 0) later; the late purge must not wipe the new L1."""
    index = PrefixIndex()
    counts = Counts()
    applier, rehasher = KvtierApplier(index, count=counts), VllmRehasher("r1", index)
    rehasher.apply(5, vllm_batch(stored([1, 2], TOKENS[:8])), 0.0, counts)
    applier.apply(kv(EventKind.STORED, Tier.L1, epoch="e1"), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L2, HASHES[3:], epoch="e1", seq=1), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L1, epoch="e2"), now=1.0)  # restarted
    assert index.match(HASHES) == {"r1": [Tier.L0, Tier.L0, Tier.L1, Tier.L1]}
    rehasher.apply(0, vllm_batch(stored([11], TOKENS[:4])), 1.1, counts)  # restart seen
    assert index.match(HASHES) == {"r1": [Tier.L0, Tier.L1, Tier.L1, Tier.L1]}
    assert index.match(HASHES, replicas=["r2"])["r2"] == []
    assert SHARED in index.replicas()  # the pool's block 3 stays
    assert counts.calls.count(("vllm", "restart")) == 1
    assert counts.calls.count(("kvtier", "restart")) == 1


def vllm_batch(*events: dict) -> bytes:
    return msgspec.msgpack.encode([time.time(), list(events), None])


def stored(ext: list, tokens: list[int], parent: object = None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": ext,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_vllm_stored_blocks_are_rehashed_into_kvtier_hashes_through_parents() -> None:
    index = PrefixIndex()
    rehasher = VllmRehasher("r1", index)
    counted: list[tuple[str, str]] = []

    def count(source: str, kind: str) -> None:
        counted.append((source, kind))

    rehasher.apply(0, vllm_batch(stored([b"seed-a", 77], TOKENS[:8])), 0.0, count)
    rehasher.apply(1, vllm_batch(stored([b"x" * 32, 9], TOKENS[8:], parent=77)), 0.0, count)
    assert index.match(HASHES) == {"r1": [Tier.L0] * 4}
    rehasher.apply(
        2, vllm_batch({"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}), 0.0, count
    )
    assert index.match(HASHES) == {"r1": [Tier.L0] * 3}
    rehasher.apply(3, vllm_batch({"type": "AllBlocksCleared"}), 0.0, count)
    assert len(index) == 0
    assert counted == [
        ("vllm", "BlockStored"),
        ("vllm", "BlockStored"),
        ("vllm", "BlockRemoved"),
        ("vllm", "AllBlocksCleared"),
    ]


def test_vllm_lora_blocks_are_rehashed_from_the_adapters_root_as_the_connector_names_them() -> None:
    index = PrefixIndex()
    paths = {"sql": "/adapters/sql"}  # what the replica's /v1/models says
    rehasher = VllmRehasher("r1", index, adapter_path=paths.get)
    # vLLM 0.32 events of a request to adapter "sql": each block's extra keys, untagged
    first = {**stored([11, 12], TOKENS[:8]), "lora_id": 1, "lora_name": "sql"}
    rest = {**stored([13, 14], TOKENS[8:], parent=12), "lora_id": 1, "lora_name": "sql"}
    first["extra_keys"], rest["extra_keys"] = [("sql",)] * 2, [("sql",)] * 2
    rehasher.apply(0, vllm_batch(first, rest), 0.0, lambda s, k: None)
    adapter = tuple(block_hashes(TOKENS, BLOCK, extra_key(lora="sql", lora_path="/adapters/sql")))
    assert index.match(adapter) == {"r1": [Tier.L0] * 4} and not any(index.match(HASHES).values())
    # the adapter's blocks with a cache salt (published untagged after the name): unnamable
    salted = {**stored([21], TOKENS[:4]), "lora_name": "sql", "extra_keys": [("sql", "t")]}
    rehasher.apply(1, vllm_batch(salted), 0.0, lambda s, k: None)
    assert rehasher.unnamed == 1 and len(index) == 4
    # an adapter /v1/models has not listed (its path unknown): unnamable too
    unknown = {**stored([31], TOKENS[:4]), "lora_name": "new", "extra_keys": [("new",)]}
    rehasher.apply(2, vllm_batch(unknown), 0.0, lambda s, k: None)
    assert rehasher.unnamed == 2 and len(index) == 4


def test_all_blocks_cleared_drops_vllms_l0_and_keeps_kvtiers_l1() -> None:
    """`/reset_prefix_cache` clears vLLM's cache, not the connector's L1."""
    index = PrefixIndex()
    applier, rehasher = KvtierApplier(index), VllmRehasher("r1", index)
    rehasher.apply(0, vllm_batch(stored([1, 2, 3, 4], TOKENS)), 0.0, Counts())
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:2]), now=0.0)
    rehasher.apply(1, vllm_batch({"type": "AllBlocksCleared"}), 1.0, Counts())
    assert index.match(HASHES) == {"r1": [Tier.L1, Tier.L1]}


def test_vllm_block_with_an_unknown_parent_is_skipped_not_misnamed() -> None:
    index = PrefixIndex()
    rehasher = VllmRehasher("r1", index)
    rehasher.apply(0, vllm_batch(stored([5], TOKENS[4:8], parent=4)), 0.0, lambda s, k: None)
    assert len(index) == 0 and rehasher.unnamed == 1


def test_vllm_sequence_going_backwards_means_a_restart_and_purges_its_l0() -> None:
    index = PrefixIndex()
    counts = Counts()
    rehasher = VllmRehasher("r1", index)
    rehasher.apply(5, vllm_batch(stored([1], TOKENS[:4])), 0.0, counts)
    rehasher.apply(0, vllm_batch(), 1.0, counts)
    assert counts.calls == [("vllm", "BlockStored"), ("vllm", "restart")] and len(index) == 0


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_event_feed_applies_published_kvtier_events_over_zmq() -> None:
    async def scenario() -> None:
        endpoint = _free_endpoint()
        index = PrefixIndex()
        with EventPublisher(endpoint, "r1") as pub:
            feed = EventFeed(index, [endpoint], {}, lambda s, k: None, time.monotonic, 1000)
            feed.start()
            try:
                for _ in range(100):  # PUB/SUB drops until the subscription propagates
                    pub.publish(EventKind.STORED, Tier.L1, HASHES)
                    await asyncio.sleep(0.05)
                    if len(index):
                        break
            finally:
                await feed.close()
        assert index.match(HASHES) == {"r1": [Tier.L1] * 4}

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_router_started_after_the_stores_learns_them_without_new_events() -> None:
    """A restarted router: the replica's publisher re-announces what it holds on subscription."""

    async def scenario() -> None:
        endpoint = _free_endpoint()
        index = PrefixIndex()
        with EventPublisher(endpoint, "r1") as pub:
            pub.publish(EventKind.STORED, Tier.L1, HASHES)
            pub.publish(EventKind.STORED, Tier.L2, HASHES[:2])
            await asyncio.sleep(0.3)  # sent to nobody: no subscriber yet
            feed = EventFeed(index, [endpoint], {}, lambda s, k: None, time.monotonic, 1000)
            feed.start()
            try:
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if len(index) == 6:
                        break
            finally:
                await feed.close()
            assert pub.snapshots == 1
            assert pub.published == 5  # 2 stores; L1's cleared-event, 1 stored-event a tier
        assert index.match(HASHES, replicas=["r2"]) == {"r1": [Tier.L1] * 4, "r2": [Tier.L2] * 2}

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_jump_in_a_replicas_sequence_is_counted_as_a_gap_and_a_restart_is_not() -> None:
    index = PrefixIndex()
    counted: list[tuple[str, str]] = []
    applier = KvtierApplier(index, count=lambda *c: counted.append(c))
    for seq in (5, 6, 9, 10):  # 7 and 8 lost
        applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], seq=seq), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], replica="r2", seq=40), now=0.0)
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], epoch="e2", seq=0), now=0.0)
    assert counted == [("kvtier", "gap"), ("kvtier", "restart")]


def test_a_snapshot_past_lost_events_is_no_gap_and_a_gap_asks_for_one() -> None:
    """A snapshot's events carry the number of the last event sent: they stand for everything
    up to it, so those lost before them leave nothing to repair."""
    index = PrefixIndex()
    counts, gaps = Counts(), Counts()
    applier = KvtierApplier(index, count=counts, on_gap=lambda pub: gaps("gap", pub.replica))
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], seq=5), now=0.0)
    snapshot = KVEvent(EventKind.STORED, "r1", "e1", Tier.L1, HASHES, 9, snapshot=True)
    applier.apply(snapshot, now=0.0)  # 6 to 8 lost, but the snapshot says what they did
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], seq=10), now=0.0)
    assert counts.calls == [] and gaps.calls == []
    applier.apply(kv(EventKind.STORED, Tier.L1, HASHES[:1], seq=12), now=0.0)  # 11 lost
    assert counts.calls == [("kvtier", "gap")] and gaps.calls == [("gap", "r1")]


def test_a_jump_in_vllms_sequence_is_counted_as_a_gap_and_leaves_descendants_unnamed() -> None:
    index = PrefixIndex()
    counts = Counts()
    rehasher = VllmRehasher("r1", index)
    rehasher.apply(0, vllm_batch(stored([1], TOKENS[:4])), 0.0, counts)
    rehasher.apply(1, vllm_batch(stored([2], TOKENS[4:8], parent=1)), 0.0, counts)
    rehasher.apply(3, vllm_batch(stored([4], TOKENS[12:], parent=3)), 0.0, counts)  # 2 lost
    assert counts.calls.count(("vllm", "gap")) == 1 and ("vllm", "restart") not in counts.calls
    assert index.match(HASHES) == {"r1": [Tier.L0] * 2} and rehasher.unnamed == 1
    assert rehasher.last_seq == 3


# --- gaps in vLLM's events over real sockets: vLLM's own publisher, a link that loses batches


class LossyLink:
    """A hop between vLLM's publisher and the router (a network path): forwards every batch,
    but drops those that pass while `dropping` is set (a blip, a full queue)."""

    def __init__(self, upstream: str, downstream: str) -> None:
        ctx = zmq.asyncio.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._pub = ctx.socket(zmq.PUB)
        for sock in (self._sub, self._pub):
            sock.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub.bind(downstream)
        self.dropping = False
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    async def _forward(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if self.dropping:
                self.dropped += 1
            else:
                await self._pub.send_multipart(frames)

    async def __aenter__(self) -> LossyLink:
        self._task = asyncio.create_task(self._forward())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sub.close(0)
        self._pub.close(0)


async def _until(done: Callable[[], bool], act: Callable[[], object] = lambda: None) -> None:
    """Call `act` and wait 50 ms, until `done()`; at most 100 times (5 s)."""
    for _ in range(100):
        act()
        await asyncio.sleep(0.05)
        if done():
            return
    raise AssertionError("timed out")


def _lose_two_batches(
    tmp_path: Path, replay: str | None, timeout_s: float = 1.0, at_start: bool = False
) -> tuple[PrefixIndex, Counts]:
    """vLLM's `ZmqEventPublisher` (its replay socket bound at ipc://TMP/replay) publishes
    blocks 1-4 of one prompt, a batch each, to a feed following it through a `LossyLink`
    that loses the batches of blocks 2 and 3; the feed asks `replay` (None: no replay) for
    gaps; `at_start`: the feed is given both endpoints when built, else by `connect_vllm`.
    Returns the index and the counts once block 4's batch is applied."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    def batch(block: int) -> KVEventBatch:
        tokens = TOKENS[(block - 1) * BLOCK : block * BLOCK]
        parent = block - 1 if block > 1 else None
        event = BlockStored([block], parent, tokens, BLOCK, None, "GPU", None)
        return KVEventBatch(ts=time.time(), events=[event])

    async def scenario() -> None:
        engine, link = f"ipc://{tmp_path}/engine", f"ipc://{tmp_path}/link"
        feed = EventFeed(
            index,
            (),
            {"r1": link} if at_start else {},
            counts,
            time.monotonic,
            1000,
            vllm_replay={"r1": replay} if at_start and replay else None,
            replay_timeout_s=timeout_s,
        )
        publisher = ZmqEventPublisher(0, engine, f"ipc://{tmp_path}/replay", topic="kv")
        try:
            async with LossyLink(engine, link) as hop:
                if not at_start:
                    feed.connect_vllm("r1", link, replay)
                feed.start()
                await _until(lambda: len(index) == 1, lambda: publisher.publish(batch(1)))
                await asyncio.sleep(0.2)  # a block-1 batch still on its way passes too
                hop.dropping = True
                publisher.publish(batch(2))
                publisher.publish(batch(3))
                await _until(lambda: hop.dropped == 2)
                hop.dropping = False
                applied = counts.calls.count(("vllm", "BlockStored"))
                publisher.publish(batch(4))
                await _until(  # block 4's batch, after those replayed
                    lambda: (
                        counts.calls.count(("vllm", "BlockStored"))
                        > applied + counts.calls.count(("vllm", "replayed"))
                    )
                )
        finally:
            await feed.close()
            publisher.shutdown()

    index, counts = PrefixIndex(), Counts()
    asyncio.run(asyncio.wait_for(scenario(), 30))
    return index, counts


@pytest.mark.parametrize("at_start", [False, True], ids=["connected", "at_start"])
def test_a_gap_in_vllms_events_is_filled_from_its_replay_endpoint(
    tmp_path: Path, at_start: bool
) -> None:
    index, counts = _lose_two_batches(tmp_path, f"ipc://{tmp_path}/replay", at_start=at_start)
    assert index.match(HASHES) == {"r1": [Tier.L0] * 4}  # blocks 2, 3 replayed: 4 named
    assert counts.calls.count(("vllm", "replayed")) == 2
    assert ("vllm", "gap") not in counts.calls and ("vllm", "replay_failed") not in counts.calls


def test_without_a_replay_endpoint_a_gap_is_counted_and_its_descendants_stay_unnamed(
    tmp_path: Path,
) -> None:
    index, counts = _lose_two_batches(tmp_path, None)
    assert index.match(HASHES) == {"r1": [Tier.L0]}  # block 4's parent was never named
    assert counts.calls.count(("vllm", "gap")) == 1 and ("vllm", "replayed") not in counts.calls


def test_a_replay_endpoint_that_does_not_answer_is_counted_and_the_gap_stays(
    tmp_path: Path,
) -> None:
    index, counts = _lose_two_batches(tmp_path, f"ipc://{tmp_path}/nobody", timeout_s=0.3)
    assert index.match(HASHES) == {"r1": [Tier.L0]}
    assert counts.calls.count(("vllm", "replay_failed")) == 1
    assert counts.calls.count(("vllm", "gap")) == 1  # block 4 applied after the timeout


# --- gaps in kvtier's events over real sockets: a router too slow to read them all

FLOOD = 20_000
"""Stored-events published while the router cannot read: far more than the ZMQ queues between
a publisher and a subscriber over ipc hold (about a thousand messages each side)."""


def _block(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def _held(index: PrefixIndex, blocks: list[BlockHash]) -> int:
    """How many of `blocks` the index says replica r1 holds in L1."""
    return sum(index.match([h]).get("r1") == [Tier.L1] for h in blocks)


def _flood_a_stalled_router(
    pub: EventPublisher, blocks: list[BlockHash], removed: list[BlockHash]
) -> None:
    """Publish a stored-event per block, then the removal of `removed`, while the router's
    event loop is held (it takes in no more events, so the queues fill and the publisher's
    socket drops the rest: the removal last of all)."""
    for block in blocks:
        pub.publish(EventKind.STORED, Tier.L1, [block])
    pub.publish(EventKind.REMOVED, Tier.L1, removed)
    time.sleep(1.0)  # holds the loop: the sender pushes what fits, the rest is lost


@dataclass
class Flooded:
    """What `_lose_in_a_flood` left: the router's index and counts, the flooded blocks, and
    the number of snapshots each bystander sent."""

    index: PrefixIndex
    counts: Counts
    blocks: list[BlockHash]
    bystander_snapshots: list[int]


def _lose_in_a_flood(tmp_path: Path, stale: list[BlockHash], bystanders: int = 0) -> Flooded:
    """A feed follows a publisher, r1, over ipc (resyncs 0.5 s apart at most) and `bystanders`
    more (r2, ...), each holding one L1 block it stored before the feed started; the `stale`
    blocks are stored in L1 and L2 and seen; a flood of `FLOOD` stored blocks, then the removal
    of `stale` from L1, reaches a stalled router, which loses some of r1's events (asserted);
    one more event shows the gap. Returns once the index holds every flooded block (at most
    10 s), and a snapshot round more has passed."""
    blocks = [_block(i) for i in range(FLOOD)]
    index, counts = PrefixIndex(), Counts()
    sent: list[int] = []

    async def scenario() -> None:
        endpoint = f"ipc://{tmp_path}/kv"
        with ExitStack() as stack:
            pub = stack.enter_context(EventPublisher(endpoint, "r1", max_queue=2 * FLOOD))
            others = [_bystander(stack, tmp_path, f"r{i}") for i in range(2, 2 + bystanders)]
            endpoints = [endpoint, *(other.endpoint for other in others)]
            feed = EventFeed(
                index, endpoints, {}, counts, time.monotonic, 1000, resync_interval_s=0.5
            )
            feed.start()
            try:
                probe = [*stale, _block(FLOOD)]
                await _until(
                    lambda: _held(index, probe) == len(probe),
                    lambda: pub.publish(EventKind.STORED, Tier.L1, probe),
                )
                pub.publish(EventKind.STORED, Tier.L2, stale)
                await asyncio.sleep(0.3)  # the router learns of it
                _flood_a_stalled_router(pub, blocks, stale)
                await asyncio.sleep(1.0)  # the router reads what reached it
                assert _held(index, blocks) < FLOOD  # events really lost
                pub.publish(EventKind.STORED, Tier.L1, probe[-1:])  # its number jumps: a gap
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    if _held(index, blocks) == FLOOD:
                        break
                await asyncio.sleep(SNAPSHOT_MIN_INTERVAL_S)  # any other answer is sent by now
                sent.extend(other.snapshots for other in others)
            finally:
                await feed.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    return Flooded(index, counts, blocks, sent)


def _bystander(stack: ExitStack, tmp_path: Path, replica: str) -> EventPublisher:
    """A publisher at ipc://TMP/`replica` that stored `replica`'s own block in L1."""
    pub = stack.enter_context(EventPublisher(f"ipc://{tmp_path}/{replica}", replica))
    pub.publish(EventKind.STORED, Tier.L1, [_own_block(replica)])
    return pub


def _own_block(replica: str) -> BlockHash:
    return BlockHash(replica.encode().rjust(16, b"\0"))


def test_blocks_whose_stored_events_a_slow_router_lost_come_back_with_a_resync(
    tmp_path: Path,
) -> None:
    flooded = _lose_in_a_flood(tmp_path, [])
    assert _held(flooded.index, flooded.blocks) == FLOOD
    assert ("kvtier", "gap") in flooded.counts.calls
    assert flooded.counts.calls.count(("kvtier", "resync")) == 1


def test_an_entry_whose_removal_a_slow_router_lost_goes_with_the_resync(tmp_path: Path) -> None:
    stale = [_block(FLOOD + 1)]
    flooded = _lose_in_a_flood(tmp_path, stale)
    assert _held(flooded.index, flooded.blocks) == FLOOD
    assert flooded.index.match(stale) == {"r1": [Tier.L2]}  # L1's entry gone; the pool's stays


def test_a_resync_asks_only_the_replica_whose_events_were_lost(tmp_path: Path) -> None:
    """Every replica's snapshot at the join; after r1's gap, r1's alone (in a fleet of many,
    every replica answering would send the slow router far more than it lost)."""
    flooded = _lose_in_a_flood(tmp_path, [], bystanders=2)
    assert _held(flooded.index, flooded.blocks) == FLOOD
    assert flooded.counts.calls.count(("kvtier", "resync")) == 1
    assert flooded.bystander_snapshots == [1, 1]  # the join's, no more
    for replica in ("r2", "r3"):
        assert flooded.index.match([_own_block(replica)]).get(replica) == [Tier.L1]


def test_a_burst_of_gaps_gets_at_most_one_resync_an_interval(tmp_path: Path) -> None:
    """A publisher whose one-event queue drops most of a steady stream: a gap every few events,
    for about two intervals."""
    interval = 1.0
    counts = Counts()

    async def scenario() -> float:
        endpoint = f"ipc://{tmp_path}/kv"
        index = PrefixIndex()
        with EventPublisher(endpoint, "r1", max_queue=1) as pub:
            started = time.monotonic()  # the join, the first request, comes after it
            feed = EventFeed(
                index, [endpoint], {}, counts, time.monotonic, 1000, resync_interval_s=interval
            )
            feed.start()
            try:
                for i in range(200):  # 2 s
                    for j in range(20):
                        pub.publish(EventKind.STORED, Tier.L1, [_block(20 * i + j)])
                    await asyncio.sleep(0.01)
            finally:
                await feed.close()
            return time.monotonic() - started

    elapsed = asyncio.run(asyncio.wait_for(scenario(), 30))
    gaps = counts.calls.count(("kvtier", "gap"))
    resyncs = counts.calls.count(("kvtier", "resync"))
    assert gaps > 10 * (1 + elapsed / interval)
    assert 1 <= resyncs <= elapsed / interval  # the join counts as the first request
