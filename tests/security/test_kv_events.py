"""KV events accept nothing from outside the fleet: CURVE-authenticated publishers only, events
for replicas the router serves only, malformed or oversized frames dropped (feed alive)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from kvtier.core.errors import ConfigError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import (
    CURVE_SECRET_ENV,
    MAX_EVENT_BYTES,
    SNAPSHOT_MIN_INTERVAL_S,
    SNAPSHOT_TOPIC_PREFIX,
    SNAPSHOTS_PER_ROUND,
    TOPIC,
    EventPublisher,
    EventSubscriber,
    curve_secret_from_env,
    encode,
)
from kvtier.router.event_feed import KvtierApplier
from kvtier.router.index import PrefixIndex
from tests.helpers.router import free_endpoint
from tests.helpers.tiers import hash_of

HASHES = [hash_of("a"), hash_of("b")]


def heard(sub: EventSubscriber, pub: EventPublisher, timeout_s: float = 3.0) -> bool:
    """Whether `sub` receives what `pub` publishes (PUB/SUB needs a moment to connect); events
    of other publishers (snapshots sent as `sub` joins them) do not count."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.publish(EventKind.STORED, Tier.L1, HASHES)
        event = sub.recv(0.1)
        if event is not None and event.epoch == pub.epoch:
            return True
    return False


def test_a_curve_subscriber_hears_only_the_fleets_publishers() -> None:
    fleet_public, fleet_secret = zmq.curve_keypair()
    _, stranger_secret = zmq.curve_keypair()
    good, stranger, plain = free_endpoint(), free_endpoint(), free_endpoint()
    with (
        EventPublisher(good, "r1", curve_secret_key=fleet_secret) as pub_good,
        EventPublisher(stranger, "r1", curve_secret_key=stranger_secret) as pub_stranger,
        EventPublisher(plain, "r1") as pub_plain,
        EventSubscriber([good, stranger, plain], curve_server_key=fleet_public) as sub,
    ):
        assert heard(sub, pub_good)
        assert not heard(sub, pub_stranger, 1.5)
        assert not heard(sub, pub_plain, 1.5)
        with EventSubscriber([good]) as no_curve:  # no key: cannot read the fleet's events
            assert not heard(no_curve, pub_good, 1.5)


def test_the_publishers_secret_key_comes_from_a_file_named_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public, secret = zmq.curve_keypair()
    key_file = tmp_path / "events.key"
    key_file.write_bytes(secret + b"\n")
    monkeypatch.setenv(CURVE_SECRET_ENV, str(key_file))
    assert curve_secret_from_env() == secret
    endpoint = free_endpoint()
    with (
        EventPublisher(endpoint, "r1") as pub,
        EventSubscriber([endpoint], curve_server_key=public.decode()) as sub,
    ):
        assert heard(sub, pub)
    key_file.write_text("short")
    with pytest.raises(ConfigError, match="no Z85 CURVE key"):
        curve_secret_from_env()


def test_events_for_replicas_the_router_does_not_serve_are_ignored() -> None:
    index = PrefixIndex(1000)
    applier = KvtierApplier(index, {"r1", "r2"}.__contains__)
    stored = KVEvent(EventKind.STORED, "r1", "e1", Tier.L1, tuple(HASHES), 0)
    assert applier.apply(stored, 0.0)
    forged = [
        KVEvent(EventKind.STORED, "intruder", "e9", Tier.L1, tuple(HASHES), 0),
        KVEvent(EventKind.CLEARED, "intruder", "e9", Tier.L2, (), 1),
    ]
    assert not any(applier.apply(e, 0.0) for e in forged)
    assert index.replicas() == {"r1"}


def test_oversized_and_malformed_frames_are_dropped_and_counted() -> None:
    endpoint = free_endpoint()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    try:
        with EventSubscriber([endpoint]) as sub:
            good = encode(KVEvent(EventKind.STORED, "r1", "e", Tier.L1, tuple(HASHES), 0))
            deadline = time.monotonic() + 5
            while sub.recv(0.05) is None:  # wait for the subscription
                pub.send_multipart([TOPIC, good])
                assert time.monotonic() < deadline
            for frames in (
                [TOPIC, b"[" * 100_000],
                [TOPIC, b'{"v": true}'],
                [TOPIC, good, b"extra"],
                [TOPIC, b"x" * (MAX_EVENT_BYTES + 4096)],
            ):
                pub.send_multipart(frames)
            deadline = time.monotonic() + 5
            event = None
            while event is None and time.monotonic() < deadline:
                pub.send_multipart([TOPIC, good])
                event = sub.recv(0.1)
            assert event is not None and event.replica == "r1"
            assert sub.malformed == 4
    finally:
        pub.close(0)


def test_subscribing_over_and_over_gets_few_snapshots_a_second() -> None:
    """A client joining under a new snapshot topic each time (no CURVE, a port open to it)
    cannot make the replica send its holdings more than `SNAPSHOTS_PER_ROUND` times a
    second."""
    endpoint = free_endpoint()
    with EventPublisher(endpoint, "r1") as pub:
        pub.publish(EventKind.STORED, Tier.L1, HASHES)
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.SUB)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(endpoint)
        try:
            started = time.monotonic()
            for i in range(200):  # 200 joins within about half a second
                topic = SNAPSHOT_TOPIC_PREFIX + f"{i:016x}".encode()
                raw.setsockopt(zmq.SUBSCRIBE, topic)
                time.sleep(0.0025)
            time.sleep(0.3)
            elapsed = time.monotonic() - started
            rounds = 1 + elapsed / SNAPSHOT_MIN_INTERVAL_S
            assert 1 <= pub.snapshots <= SNAPSHOTS_PER_ROUND * rounds
        finally:
            raw.close(0)
