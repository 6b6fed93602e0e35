"""The KV event wire format and the ZMQ publisher/subscriber pair, over real loopback sockets."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import ExitStack
from dataclasses import replace

import pytest
import zmq

from kvtier.core.errors import CodecError, ConfigError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import BlockHash, block_hashes
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import (
    SNAPSHOT_MIN_INTERVAL_S,
    SNAPSHOT_TOPIC_PREFIX,
    EventPublisher,
    EventSubscriber,
    PublisherId,
    decode,
    encode,
)


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _hashes(n: int) -> tuple:
    return tuple(block_hashes(list(range(128 * n)), 128))


def test_encode_then_decode_returns_the_same_event() -> None:
    event = KVEvent(
        kind=EventKind.STORED,
        replica="http://127.0.0.1:8001",
        epoch="ab12",
        tier=Tier.L2,
        hashes=_hashes(3),
        seq=41,
    )
    assert decode(encode(event)) == event


def test_cleared_event_with_no_hashes_roundtrips() -> None:
    event = KVEvent(kind=EventKind.CLEARED, replica="r", epoch="e", tier=Tier.L1, hashes=(), seq=0)
    assert decode(encode(event)) == event


_GOOD = {
    "v": 1,
    "kind": "stored",
    "replica": "r",
    "epoch": "e",
    "tier": "l1",
    "seq": 0,
    "hashes": [],
}


@pytest.mark.parametrize(
    "frame",
    [
        b"not json",
        json.dumps(_GOOD | {"v": 2}).encode(),
        json.dumps(_GOOD | {"tier": "l9"}).encode(),
        json.dumps(_GOOD | {"hashes": ["abcd"]}).encode(),
        json.dumps(_GOOD | {"seq": "x"}).encode(),
        json.dumps({k: v for k, v in _GOOD.items() if k != "epoch"}).encode(),
    ],
)
def test_malformed_frames_raise_codec_error(frame: bytes) -> None:
    with pytest.raises(CodecError):
        decode(frame)


def test_subscriber_receives_publisher_events_in_order_with_sequence_numbers() -> None:
    endpoint = _free_endpoint()
    hashes = _hashes(2)
    with EventPublisher(endpoint, "replica-a") as pub, EventSubscriber([endpoint]) as sub:
        # PUB/SUB drops messages until the subscription has propagated: probe until one arrives.
        probe = None
        first_seq = 0  # after the probes' numbers (snapshot events take none)
        for _ in range(50):
            pub.publish(EventKind.CLEARED, Tier.L1, ())
            first_seq += 1
            probe = sub.recv(timeout_s=0.1)
            if probe is not None:
                break
        assert probe is not None
        sub.drain(timeout_s=0.2)  # probes still in flight
        pub.publish(EventKind.STORED, Tier.L1, hashes[:1])
        pub.publish(EventKind.STORED, Tier.L2, hashes)
        pub.publish(EventKind.REMOVED, Tier.L1, hashes[:1])
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            got += sub.drain(timeout_s=0.5)
    assert [(e.kind, e.tier, e.hashes, e.seq) for e in got] == [
        (EventKind.STORED, Tier.L1, hashes[:1], first_seq),
        (EventKind.STORED, Tier.L2, hashes, first_seq + 1),
        (EventKind.REMOVED, Tier.L1, hashes[:1], first_seq + 2),
    ]
    assert {e.replica for e in got} == {"replica-a"}
    assert {e.epoch for e in got} == {pub.epoch}


def test_each_publisher_start_has_a_new_epoch() -> None:
    a = EventPublisher(_free_endpoint(), "r")
    b = EventPublisher(_free_endpoint(), "r")
    try:
        assert a.epoch != b.epoch
    finally:
        a.close()
        b.close()


def test_publisher_rejects_an_endpoint_already_bound() -> None:
    endpoint = _free_endpoint()
    with EventPublisher(endpoint, "r"), pytest.raises(ConfigError, match="events_endpoint"):
        EventPublisher(endpoint, "r2")


def test_subscriber_skips_and_counts_malformed_frames() -> None:
    endpoint = _free_endpoint()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.bind(endpoint)
    try:
        with EventSubscriber([endpoint]) as sub:
            good = encode(
                KVEvent(
                    kind=EventKind.STORED, replica="r", epoch="e", tier=Tier.L1, hashes=(), seq=5
                )
            )
            event = None
            for _ in range(50):
                raw.send_multipart([b"kvtier.kv", b"garbage"])
                raw.send_multipart([b"kvtier.kv", good])
                event = sub.recv(timeout_s=0.1)
                if event is not None:
                    break
            assert event is not None and event.seq == 5
            assert sub.malformed >= 1
    finally:
        raw.close(0)


def _collect(sub: EventSubscriber, want: int, timeout_s: float = 10.0) -> list[KVEvent]:
    got: list[KVEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += sub.drain(timeout_s=0.2)
    return got


def test_a_subscriber_that_joins_late_hears_what_the_replica_still_holds() -> None:
    endpoint = _free_endpoint()
    hashes = _hashes(5)
    with EventPublisher(endpoint, "replica-a") as pub:
        pub.publish(EventKind.STORED, Tier.L1, hashes[:3])
        pub.publish(EventKind.STORED, Tier.L2, hashes)
        pub.publish(EventKind.REMOVED, Tier.L1, hashes[1:2])
        time.sleep(0.3)  # sent to nobody: no subscriber yet
        with EventSubscriber([endpoint]) as sub:
            got = _collect(sub, 3)
            assert pub.snapshots == 1
            assert sub.drain(timeout_s=0.3) == []  # one snapshot, nothing else
    assert [(e.kind, e.tier, e.hashes) for e in got] == [
        (EventKind.CLEARED, Tier.L1, ()),  # L1 is the replica's own: the listing replaces it
        (EventKind.STORED, Tier.L1, (hashes[0], hashes[2])),
        (EventKind.STORED, Tier.L2, hashes),  # the pool is every replica's: no cleared-event
    ]
    assert {e.epoch for e in got} == {pub.epoch}
    assert {e.seq for e in got} == {2}  # the last number sent: no jump for anyone
    assert all(e.snapshot for e in got)


def test_a_second_subscriber_gets_its_own_snapshot_and_the_first_hears_nothing_of_it() -> None:
    """A router joining must not make the replica re-send its holdings to every router (with
    many replicas, each new router would flood the others' indexes)."""
    endpoint = _free_endpoint()
    hashes = _hashes(2)
    with EventPublisher(endpoint, "replica-a") as pub:
        pub.publish(EventKind.STORED, Tier.L1, hashes)
        time.sleep(0.3)  # sent to nobody: each subscriber hears it only in its snapshot
        with EventSubscriber([endpoint]) as first:
            assert [e.hashes for e in _collect(first, 2)] == [(), hashes]
            with EventSubscriber([endpoint]) as second:
                assert [e.hashes for e in _collect(second, 2)] == [(), hashes]
                assert pub.snapshots == 2
                assert first.drain(timeout_s=SNAPSHOT_MIN_INTERVAL_S) == []


class _HeldSender(EventPublisher):
    """A publisher whose sender can be held right after one send, and told a subscriber
    joined, so a snapshot lands exactly between queued events."""

    def __init__(self, endpoint: str) -> None:
        self.hold = threading.Event()
        self.release = threading.Event()
        self.join = threading.Event()
        super().__init__(endpoint, "r1")

    def _send(self, event: KVEvent) -> None:
        super()._send(event)
        if self.hold.is_set():
            self.hold.clear()
            self.release.wait(10)

    def _read_joins(self, due: dict[bytes, None]) -> None:
        super()._read_joins(due)
        if self.join.is_set():
            self.join.clear()
            due[self.joiner] = None

    joiner = b""
    """The snapshot topic `join` stands for."""


def test_a_snapshot_sent_amid_queued_events_keeps_their_numbers_in_order() -> None:
    """A router joining while events are still queued gets a snapshot sent between them: it
    must see no jump in the sequence numbers (a router counts one as lost events), and the live
    events' numbers must still only go up."""
    endpoint = _free_endpoint()
    with _HeldSender(endpoint) as pub, EventSubscriber([endpoint]) as sub:
        pub.joiner = next(iter(sub._topics))  # the join's
        for _ in range(50):  # until the subscription has propagated
            pub.publish(EventKind.STORED, Tier.L1, _hashes(1))
            if sub.recv(timeout_s=0.1) is not None:
                break
        sub.drain(timeout_s=0.3)
        time.sleep(SNAPSHOT_MIN_INTERVAL_S)  # (the first join's snapshot may have just run)
        pub.hold.set()
        fresh = [BlockHash(i.to_bytes(16, "big")) for i in range(100)]
        for block in fresh:  # the sender sends the first, then waits: 99 stay queued
            pub.publish(EventKind.STORED, Tier.L1, [block])
        pub.join.set()
        pub.release.set()
        events: list[KVEvent] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(_live(events, fresh)) < 100:
            events += sub.drain(timeout_s=0.2)
    assert pub.snapshots >= 1 and any(e.snapshot for e in events)
    seqs = [e.seq for e in events]
    assert all(b - a in (0, 1) for a, b in zip(seqs, seqs[1:], strict=False))  # no jump
    live = _live(events, fresh)
    assert live == sorted(set(live)) and len(live) == 100


def _live(events: list[KVEvent], fresh: list[BlockHash]) -> list[int]:
    """The numbers of the live events that each stored one of `fresh`."""
    return [e.seq for e in events if not e.snapshot and len(e.hashes) == 1 and e.hashes[0] in fresh]


def test_a_resync_gets_a_fresh_snapshot_on_a_new_topic_and_the_others_hear_nothing() -> None:
    endpoint = _free_endpoint()
    hashes = _hashes(2)
    with EventPublisher(endpoint, "replica-a") as pub:
        pub.publish(EventKind.STORED, Tier.L1, hashes)
        time.sleep(0.3)  # sent to nobody: each subscriber hears it only in a snapshot
        with (
            EventSubscriber([endpoint]) as other,
            EventSubscriber([endpoint], resync_interval_s=0.0) as sub,
        ):
            _collect(other, 2)
            first = _collect(sub, 2)
            old_topics = set(sub._topics)
            assert sub.resync()
            again = _collect(sub, 2)
            assert old_topics.isdisjoint(sub._topics)
            assert other.drain(timeout_s=SNAPSHOT_MIN_INTERVAL_S) == []
            assert sub.malformed == 0
        assert pub.snapshots == 3
    assert [(e.kind, e.hashes, e.snapshot) for e in again] == [
        (EventKind.CLEARED, (), True),
        (EventKind.STORED, hashes, True),
    ]
    assert again == first


def test_resyncs_are_one_an_interval_the_join_included() -> None:
    with EventSubscriber(resync_interval_s=0.3) as sub:
        assert not any(sub.resync() for _ in range(100))  # the join was the last request
        time.sleep(0.35)
        assert [sub.resync() for _ in range(100)].count(True) == 1


def test_a_resync_lists_what_the_publishers_full_queue_dropped_and_numbers_past_it() -> None:
    endpoint = _free_endpoint()
    hashes = _hashes(400)
    with (
        EventPublisher(endpoint, "replica-a", max_queue=1) as pub,
        EventSubscriber([endpoint], resync_interval_s=0.0) as sub,
    ):
        pub.publish(EventKind.STORED, Tier.L1, hashes[:1])
        assert _collect(sub, 2)  # the join's snapshot: the subscription is up
        for h in hashes[1:]:  # faster than the sender drains a queue of one
            pub.publish(EventKind.STORED, Tier.L1, (h,))
        assert pub.dropped > 0
        sub.drain(timeout_s=0.5)  # the live events that got through
        assert sub.resync()
        snapshot = [e for e in _collect(sub, 2) if e.snapshot]
        pub.publish(EventKind.STORED, Tier.L1, hashes[:1])
        after = _collect(sub, 1)
    listed = {h for e in snapshot for h in e.hashes}
    assert listed == set(hashes)  # dropped or sent, every stored block is listed
    assert [e.seq for e in after] == [snapshot[-1].seq + 1]  # numbers go on: no jump


def test_a_snapshot_whose_listing_was_cut_does_not_clear_the_tier() -> None:
    """Held blocks dropped for room, then one removed: the listing is under the bound but no
    longer whole, so a cleared-event would wipe blocks the replica still holds."""
    endpoint = _free_endpoint()
    hashes = _hashes(4)
    with EventPublisher(endpoint, "replica-a", max_held_blocks=3) as pub:
        for h in hashes:
            pub.publish(EventKind.STORED, Tier.L1, (h,))
        pub.publish(EventKind.REMOVED, Tier.L1, hashes[3:])
        time.sleep(0.3)  # sent to nobody
        with EventSubscriber([endpoint]) as sub:
            got = _collect(sub, 1)
            assert sub.drain(timeout_s=0.3) == []
    assert [(e.kind, e.hashes) for e in got] == [(EventKind.STORED, hashes[1:3])]


def test_resyncs_back_off_while_gaps_go_on_and_come_back_after_a_quiet_spell() -> None:
    with EventSubscriber(resync_interval_s=0.2) as sub:
        time.sleep(0.25)
        assert sub.resync()  # right as the interval allows: the interval doubles to 0.4
        time.sleep(0.25)
        assert not sub.resync()
        time.sleep(0.2)
        assert sub.resync()  # 0.45 s on, within twice 0.4: doubles to 0.8
        time.sleep(0.45)
        assert not sub.resync()
        time.sleep(1.8)  # more than twice 0.8 since the last: back to 0.2
        assert sub.resync()
        time.sleep(0.25)
        assert sub.resync()


def _replicas(stack: ExitStack, n: int) -> list[EventPublisher]:
    """`n` publishers, replica-0 to replica-(n-1), each holding one L1 block of its own (so
    each has a snapshot to send), the block sent to nobody."""
    publishers = []
    for i, block in enumerate(_hashes(n)):
        pub = stack.enter_context(EventPublisher(_free_endpoint(), f"replica-{i}"))
        pub.publish(EventKind.STORED, Tier.L1, (block,))
        publishers.append(pub)
    time.sleep(0.3)  # sent to nobody: each subscriber hears it only in a snapshot
    return publishers


def _snapshot_senders(events: list[KVEvent]) -> list[str]:
    """The replicas whose snapshot `events` hold, each once, sorted (asserting all are)."""
    assert all(e.snapshot for e in events)
    return sorted({e.replica for e in events})


def test_the_join_asks_every_publisher_and_a_resync_naming_one_asks_it_alone() -> None:
    """A gap in one replica's events must not make every replica of the fleet re-send its
    holdings to a router that is already too slow."""
    with ExitStack() as stack:
        pubs = _replicas(stack, 3)
        sub = stack.enter_context(
            EventSubscriber([p.endpoint for p in pubs], resync_interval_s=0.0)
        )
        assert _snapshot_senders(_collect(sub, 6)) == ["replica-0", "replica-1", "replica-2"]
        assert sub.resync([PublisherId(pubs[1].replica, pubs[1].epoch)])
        again = _collect(sub, 2)
        again += sub.drain(timeout_s=SNAPSHOT_MIN_INTERVAL_S + 0.5)  # the others' round is due
        assert [p.snapshots for p in pubs] == [1, 2, 1]
        assert sub.malformed == 0
    assert [(e.replica, e.kind, e.hashes) for e in again] == [
        ("replica-1", EventKind.CLEARED, ()),
        ("replica-1", EventKind.STORED, _hashes(3)[1:2]),
    ]


def test_a_publisher_connected_after_a_targeted_resync_still_sends_its_snapshot() -> None:
    """The join's topic, naming no publisher, stays subscribed: a replica added (or
    reconnected) after a resync named another still hears it and answers."""
    with ExitStack() as stack:
        first, late = _replicas(stack, 2)
        sub = stack.enter_context(EventSubscriber([first.endpoint], resync_interval_s=0.0))
        assert _snapshot_senders(_collect(sub, 2)) == ["replica-0"]
        assert sub.resync([PublisherId(first.replica, first.epoch)])
        assert _snapshot_senders(_collect(sub, 2)) == ["replica-0"]
        sub.connect(late.endpoint)
        assert _snapshot_senders(_collect(sub, 2)) == ["replica-1"]
        assert late.snapshots == 1


def _raw_subscriber(stack: ExitStack, endpoints: list[str]) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    stack.callback(sock.close, 0)
    for endpoint in endpoints:
        sock.connect(endpoint)
    return sock


def _senders_on(sock: zmq.Socket, topic: bytes, wait_s: float) -> list[str]:
    """Subscribe `sock` to snapshot `topic`, then the replicas whose snapshot frames arrive on
    it within `wait_s`, each once, sorted."""
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    senders = set()
    deadline = time.monotonic() + wait_s
    while sock.poll(max(1, int(1000 * (deadline - time.monotonic())))):
        frame_topic, frame = sock.recv_multipart()
        assert frame_topic == topic
        senders.add(decode(frame).replica)
    return sorted(senders)


def test_snapshot_topics_on_the_wire_named_or_as_an_earlier_router_sends_them() -> None:
    """`kvtier.snap.<16 hex>/<epoch>/<replica>` asks that publisher alone; an earlier router's
    topic, `kvtier.snap.<16 hex>`, names none and every publisher still answers it."""
    with ExitStack() as stack:
        pubs = _replicas(stack, 3)
        sock = _raw_subscriber(stack, [p.endpoint for p in pubs])
        named = SNAPSHOT_TOPIC_PREFIX + b"0" * 16 + b"/" + pubs[2].epoch.encode() + b"/replica-2"
        wait_s = SNAPSHOT_MIN_INTERVAL_S + 1.0  # a round each, however late it comes
        assert _senders_on(sock, named, wait_s) == ["replica-2"]
        unnamed = SNAPSHOT_TOPIC_PREFIX + b"1" * 16
        assert _senders_on(sock, unnamed, wait_s) == ["replica-0", "replica-1", "replica-2"]
        assert [p.snapshots for p in pubs] == [1, 1, 2]


def test_an_earlier_publisher_answering_every_resync_is_heard_as_a_snapshot() -> None:
    """A replica of an earlier version answers a snapshot topic that names another replica:
    its snapshot is as valid as ever, and the subscriber takes it as one."""
    endpoint = _free_endpoint()
    with ExitStack() as stack:
        earlier = zmq.Context.instance().socket(zmq.XPUB)
        stack.callback(earlier.close, 0)
        earlier.setsockopt(zmq.XPUB_VERBOSE, 1)
        earlier.bind(endpoint)
        sub = stack.enter_context(EventSubscriber([endpoint], resync_interval_s=0.0))
        assert sub.resync([PublisherId("replica-1", "e")])
        topics = set()
        while earlier.poll(5000):  # TOPIC, the join's and the resync's, in order
            topics.add(earlier.recv()[1:])
            if len(topics) == 3:
                break
        (resync_topic,) = {t for t in topics if t.endswith(b"/e/replica-1")}
        event = KVEvent(EventKind.STORED, "replica-0", "e0", Tier.L1, _hashes(1), 3)
        earlier.send_multipart([resync_topic, encode(event)])
        got = sub.recv(timeout_s=5)
        assert got == replace(event, snapshot=True)
        assert sub.malformed == 0
