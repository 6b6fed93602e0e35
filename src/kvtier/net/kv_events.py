"""KV events on the wire: encoding, a ZMQ publisher (replica side), a ZMQ subscriber (router side).

Transport: ZeroMQ PUB/SUB. Each replica's publisher BINDS its endpoint (e.g.
`tcp://127.0.0.1:5601`); the router's subscriber CONNECTS to every replica's endpoint, so a
replica restart or a late router needs no coordination. Each message is two frames:

    frame 0  TOPIC                      b"kvtier.kv"
    frame 1  UTF-8 JSON, one event      {"v": 1, "kind": "stored", "replica": "...",
                                         "epoch": "...", "tier": "l1", "seq": 17,
                                         "hashes": ["<32 hex chars>", ...]}

JSON keeps the format readable from any language with no extra dependency. PUB/SUB drops
messages when nobody listens or a subscriber is slow; consumers detect loss by a gap in `seq`
and treat the index as a hint (routing stays correct, only less informed).

Snapshots: the publisher's socket is an XPUB, so it sees every subscription. Each subscriber
subscribes to `TOPIC` and to a snapshot topic of its own (`SNAPSHOT_TOPIC_PREFIX` + a random
id); on each such subscription (a router started, restarted or reconnected) the publisher
sends what its own events left stored (`kvtier.net.holdings`, bounded) as stored-events on
that topic alone, so the new router learns the replica's L1 and L2 blocks without waiting for
new stores, and the routers already listening hear nothing of it. Snapshot events take no
sequence number of their own: they carry the number of the last event sent (or dropped), so
neither the new subscriber nor any other sees a jump. Joins within `SNAPSHOT_MIN_INTERVAL_S` of
a snapshot wait for the next round, which serves at most `SNAPSHOTS_PER_ROUND` of them.

A snapshot starts with a cleared-event for each tier the replica's events announced for it
alone (not L2: the pool is every replica's), unless that tier's listing is incomplete (it
dropped a hash at `max_held_blocks` since the tier was last cleared: `Holdings.complete`); its
stored-events follow. Applied in order, the subscriber then holds the
replica's tier exactly as listed: entries a lost removal left stale go. Until the tier's last
stored-event is applied the subscriber knows less of it (a colder routing choice at worst). A
cleared-event is a kind every reader knows; older routers apply it the same way.

Snapshot topics: `SNAPSHOT_TOPIC_PREFIX` + 16 random hex digits names no publisher (every
publisher answers it: the join's); followed by `/` + epoch + `/` + replica (`PublisherId`, as the
publisher's events carry them) it names one, and only that publisher answers it. A subscription
reaches every publisher the subscriber is connected to; a publisher of an earlier version
(without targeted resyncs) answers every snapshot topic, named or not (its snapshot is valid
all the same), and a subscriber of that version names none, so either side may be the older.

Resync: a subscriber that sees a jump in a replica's numbers (it read too slowly: its socket's
queue, or the publisher socket's queue for it, overflowed) asks that replica for a fresh
snapshot (`EventSubscriber.resync`): it subscribes to a new snapshot topic naming it and leaves
the one it asked it on before; the join's topic, naming none, stays, so a publisher connected
or reconnected later still sends its snapshot. Resyncs are at most one per
`RESYNC_MIN_INTERVAL_S` per subscriber, the join included, each naming every replica whose gaps
came since the last. A resync costs at most, per replica named, `max_held_blocks` hashes per
tier (35 bytes each on the wire) in `SNAPSHOT_CHUNK` frames, and the interval doubles (up to
`RESYNC_MAX_INTERVAL_S`) while each resync is followed by new gaps, so a subscriber that keeps
losing events is not sent holdings over and over. The replaced topic's frames still on their
way are dropped by the SUB socket once it leaves the topic (never counted malformed), and the
new snapshot lists what they would have; the topics of the other replicas stay until they are
`NAMED_TOPIC_TTL_S` old (left by the first resync after that), so a slowly read snapshot of one
replica is not cut by the resync of another. Every topic still subscribed is sent again when
a connection is re-established, so a replica that reconnects within that time (same epoch)
answers its own named topic as well as the join's (two snapshots, once).

A jump that comes from the publisher's own event queue (`max_queue`, full) is repaired the
same way: each event published, sent or dropped, goes to a journal (`publish` only appends to
it, under the lock), which the sender thread records in its holdings before each snapshot, so
snapshots list what dropped events announced; building a snapshot never holds the lock
`publish` takes. Not detected: a snapshot cut short by the socket's high-water mark for a
subscriber so slow its queue is full (its events carry no numbers of their own); the next
gap's resync repairs it.

What is accepted: `decode` takes only a frame of at most `MAX_EVENT_BYTES` holding exactly
the fields above with their types (hashes as 32 lower-case hex digits); anything else is a
`CodecError`, counted and skipped by the subscriber. (ZMQ_MAXMSGSIZE is not used: libzmq
drops the connection on a larger message and never reconnects, which would silence a replica
for good.) The subscriber only connects (it binds nothing anyone could push to);
the router accepts events only for replicas it knows (`kvtier.router.event_feed`). With CURVE
(`curve_secret_key` on the publishers, from the Z85 key file named by
$KVTIER_EVENTS_CURVE_SECRET_FILE; `curve_server_key`, its public half, on the subscriber), the
stream is encrypted and a subscriber hears only a publisher that holds the fleet's secret key.

Callers and threads:
- `EventPublisher.publish` is called from any thread (the connector's store callbacks run on the
  scheduler thread and on L2 I/O threads); it only enqueues. One sender thread owned by the
  publisher holds the socket (ZMQ sockets are not thread-safe). A full queue drops the event and
  counts it; publishing never blocks the engine.
- `EventSubscriber.recv` / `drain` may be called from any thread; a lock serialises socket use.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Self

import zmq

from kvtier.core.clock import deadline_in, seconds_left
from kvtier.core.errors import CodecError, ConfigError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import HASH_BYTES, BlockHash
from kvtier.core.tiers.base import TIER_ORDER, Tier
from kvtier.net.holdings import Holdings

__all__ = [
    "NAMED_TOPIC_TTL_S",
    "RESYNC_MIN_INTERVAL_S",
    "SNAPSHOT_TOPIC_PREFIX",
    "TOPIC",
    "WIRE_VERSION",
    "EventPublisher",
    "EventSubscriber",
    "PublisherId",
    "curve_secret_from_env",
    "decode",
    "encode",
    "new_epoch",
]

TOPIC = b"kvtier.kv"
WIRE_VERSION = 1
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Largest event frame accepted (an event of 100,000 hashes is ~3.5 MB)."""
SNAPSHOT_CHUNK = 1000
"""Hashes per stored-event of a snapshot (~35 KB frames)."""
SUBSCRIPTION_POLL_S = 0.1
"""How often an idle publisher looks for new subscribers (the snapshot's added delay)."""
SNAPSHOT_TOPIC_PREFIX = b"kvtier.snap."
"""The start of each subscriber's own snapshot topic (not a prefix of `TOPIC`'s, nor it of this)."""
SNAPSHOT_MIN_INTERVAL_S = 1.0
"""At most one round of snapshots per interval: joins within it wait for the next round, so a
client that subscribes over and over cannot make a replica send its holdings over and over."""
SNAPSHOTS_PER_ROUND = 8
"""Snapshot topics served per round; the others wait for the next round (a client joining
under many topics gets at most this many snapshots sent a second)."""
RESYNC_MIN_INTERVAL_S = 5.0
"""At most one resync per interval per subscriber: each makes the replicas it names send that
subscriber their holdings, and the subscriber that lost events is the slow one; the gaps seen
within the interval wait for the next resync, which repairs them all at once."""
RESYNC_MAX_INTERVAL_S = 60.0
"""The interval doubles, up to this, each time a resync comes as soon as the interval allows
(gaps go on); it is back to its least once a resync comes later than twice the interval."""
NAMED_TOPIC_TTL_S = 60.0
"""A subscriber keeps a snapshot topic naming one publisher at least this long (unless a new
resync of that publisher replaces it), so the snapshot asked on it arrives whole however slowly
it is read; the first resync after that leaves it."""
_NAME_SEPARATOR = b"/"
_JOURNAL_MAX = 50_000
"""Events the journal holds at most: the sender empties it on every pass, so only a sender
stalled for that many events overflows it (the holdings are then taken as incomplete)."""
_MAX_JOINS_PENDING = 1024
"""Snapshot topics waiting at most; later joins are ignored until the queue shrinks."""
_MAX_JOINS_READ = 1000
CURVE_SECRET_ENV = "KVTIER_EVENTS_CURVE_SECRET_FILE"
"""Environment variable naming the file that holds the publishers' Z85 CURVE secret key."""
_HASH_HEX = re.compile(f"[0-9a-f]{{{2 * HASH_BYTES}}}")
_FIELDS = frozenset({"v", "kind", "replica", "epoch", "tier", "seq", "hashes"})
_KINDS = {k.value: k for k in EventKind}
_TIERS = {t.value: t for t in Tier}


def new_epoch() -> str:
    """A random id for one process lifetime of a replica."""
    return secrets.token_hex(8)


class PublisherId(NamedTuple):
    """One publisher as its events name it: the `replica` and `epoch` they carry."""

    replica: str
    epoch: str

    def topic_suffix(self) -> bytes:
        """What follows the random part of a snapshot topic naming this publisher (any string
        encodes: a lone surrogate escaped, the same on both sides)."""
        sep = _NAME_SEPARATOR
        epoch, replica = (s.encode(errors="backslashreplace") for s in (self.epoch, self.replica))
        return sep + epoch + sep + replica


def _new_snapshot_topic(publisher: PublisherId | None = None) -> bytes:
    """A snapshot topic no other subscriber, nor this one before, has used, naming `publisher`
    (it alone answers) or none (every publisher answers)."""
    topic = SNAPSHOT_TOPIC_PREFIX + new_epoch().encode()
    return topic if publisher is None else topic + publisher.topic_suffix()


def _asks(topic: bytes, publisher: PublisherId) -> bool:
    """Whether snapshot topic `topic` asks `publisher` for a snapshot: it names it, or none."""
    _, sep, name = topic.removeprefix(SNAPSHOT_TOPIC_PREFIX).partition(_NAME_SEPARATOR)
    return not sep or sep + name == publisher.topic_suffix()


class _Asked(NamedTuple):
    """A snapshot topic a subscriber listens on: the publisher it names (None: every one) and
    when it was subscribed to."""

    publisher: PublisherId | None
    at: float


def encode(event: KVEvent) -> bytes:
    """The JSON frame of one event."""
    doc = {
        "v": WIRE_VERSION,
        "kind": event.kind.value,
        "replica": event.replica,
        "epoch": event.epoch,
        "tier": event.tier.value,
        "seq": event.seq,
        "hashes": [h.hex() for h in event.hashes],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> KVEvent:
    """Parse one JSON frame; raises `CodecError` for anything but a well-formed event."""
    if len(data) > MAX_EVENT_BYTES:
        raise CodecError(f"event of {len(data)} bytes exceeds {MAX_EVENT_BYTES}")
    try:
        doc: Any = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise CodecError(f"malformed KV event: {type(exc).__name__}") from None
    if not isinstance(doc, dict) or doc.keys() != _FIELDS:
        raise CodecError("malformed KV event: not an object with exactly the event's fields")
    version, seq, hashes = doc["v"], doc["seq"], doc["hashes"]
    if type(version) is not int or version != WIRE_VERSION:
        raise CodecError(f"event wire version {version!r}, expected {WIRE_VERSION}")
    if type(seq) is not int or seq < 0:
        raise CodecError("event seq is not a non-negative integer")
    kind, tier = _KINDS.get(_text(doc["kind"])), _TIERS.get(_text(doc["tier"]))
    replica, epoch = _text(doc["replica"]), _text(doc["epoch"])
    if kind is None or tier is None or not replica or not epoch:
        raise CodecError("malformed KV event: bad kind, tier, replica or epoch")
    if not isinstance(hashes, list) or not all(
        isinstance(h, str) and _HASH_HEX.fullmatch(h) for h in hashes
    ):
        raise CodecError(f"event hashes are not {2 * HASH_BYTES} lower-case hex digits each")
    return KVEvent(
        kind=kind,
        replica=replica,
        epoch=epoch,
        tier=tier,
        hashes=tuple(BlockHash(bytes.fromhex(h)) for h in hashes),
        seq=seq,
    )


def _text(value: object, limit: int = 1024) -> str:
    """`value` if it is a string of at most `limit` characters, else ""."""
    return value if isinstance(value, str) and len(value) <= limit else ""


def curve_secret_from_env() -> bytes | None:
    """The Z85 CURVE secret key in the file $KVTIER_EVENTS_CURVE_SECRET_FILE names (None when
    unset); raises ConfigError when that file does not hold one."""
    path = os.environ.get(CURVE_SECRET_ENV)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            key = f.read(4096).strip()
    except OSError as exc:
        raise ConfigError(f"${CURVE_SECRET_ENV}: cannot read {path}: {exc}") from exc
    if len(key) != 40:
        raise ConfigError(f"${CURVE_SECRET_ENV}: {path} holds no Z85 CURVE key (40 characters)")
    return key


class EventPublisher:
    """Publishes one replica's KV events on a bound ZMQ XPUB socket.

    `publish(kind, tier, hashes)` stamps replica and epoch and enqueues; the sender thread
    numbers each event as it sends it (so a snapshot sent between queued events never puts
    numbers out of order), skipping one number per event the full queue dropped, and sends a
    snapshot of the held blocks to each new subscriber alone, on each snapshot topic that names
    this publisher or none (at most `max_held_blocks` per tier; each tier of its own listed whole
    starts with a cleared-event);
    `close()` sends what is queued (up to `linger_s`) and stops it.
    """

    def __init__(
        self,
        endpoint: str,
        replica: str,
        *,
        epoch: str | None = None,
        max_queue: int = 10_000,
        linger_s: float = 1.0,
        curve_secret_key: bytes | None = None,
        max_held_blocks: int = 100_000,
    ) -> None:
        """`curve_secret_key` (Z85): serve CURVE-encrypted events; None: the key from
        $KVTIER_EVENTS_CURVE_SECRET_FILE when set, else plain events."""
        if not endpoint:
            raise ConfigError("events_endpoint: must not be empty")
        if not replica:
            raise ConfigError("replica: must not be empty")
        if max_queue <= 0:
            raise ConfigError(f"max_queue: must be positive, got {max_queue}")
        self.endpoint = endpoint
        self.replica = replica
        self.epoch = epoch or new_epoch()
        self._identity = PublisherId(replica, self.epoch)
        self._linger_s = linger_s
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(max_queue)
        self._lock = threading.Lock()
        self._seq = 0
        """The next sequence number to send (the sender thread's)."""
        self._skipped = 0
        """Events dropped since the last one sent: numbers the next one skips."""
        self._published = 0
        self._dropped = 0
        self._journal: list[KVEvent] = []
        """Events published, sent or dropped, not yet in the holdings (under `_lock`)."""
        self._journal_lost = False
        """Whether the journal overflowed since the sender last emptied it (under `_lock`)."""
        self._holdings = Holdings(max_held_blocks)  # the sender thread's alone
        self._held_seq = 0
        """The number of the last event, sent or dropped, the holdings include."""
        self._own_tiers: set[Tier] = set()
        """The tiers this replica's events announced for it alone (the sender thread's)."""
        self._snapshots = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's join, not the first
        self._socket.setsockopt(zmq.LINGER, int(linger_s * 1000))
        secret = curve_secret_key or curve_secret_from_env()
        if secret is not None:
            self._socket.curve_secretkey = secret
            self._socket.curve_publickey = zmq.curve_public(secret)
            self._socket.curve_server = True
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            raise ConfigError(f"events_endpoint: cannot bind {endpoint}: {exc}") from exc
        self._thread = threading.Thread(
            target=self._send_loop, name="kvtier-events-pub", daemon=True
        )
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Events dropped because the queue was full."""
        return self._dropped

    @property
    def published(self) -> int:
        """Events published so far (accepted or dropped, and snapshots' events)."""
        return self._published

    @property
    def snapshots(self) -> int:
        """Snapshots sent (one per subscriber's join seen once events announced a tier)."""
        return self._snapshots

    def publish(self, kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        """Journal one event and enqueue it; never blocks (a full queue drops it, leaving a
        `seq` gap that the next snapshot covers)."""
        event = KVEvent(kind, self.replica, self.epoch, tier, tuple(hashes), seq=0)
        with self._lock:
            self._published += 1
            if len(self._journal) < _JOURNAL_MAX:
                self._journal.append(event)
            else:
                self._journal_lost = True
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self._dropped += 1
                self._skipped += 1

    def _send_loop(self) -> None:
        # Only this thread touches the socket and the holdings after construction.
        due: dict[bytes, None] = {}  # snapshot topics waiting, in join order
        last_snapshot = -SNAPSHOT_MIN_INTERVAL_S
        while True:
            self._record_journal()
            self._read_joins(due)
            if due and time.monotonic() - last_snapshot >= SNAPSHOT_MIN_INTERVAL_S:
                topics = list(due)[:SNAPSHOTS_PER_ROUND]
                for topic in topics:
                    del due[topic]
                self._send_snapshot(topics)
                last_snapshot = time.monotonic()
            try:
                event = self._queue.get(timeout=SUBSCRIPTION_POLL_S)
            except queue.Empty:
                continue
            if event is None:
                break
            self._send(replace(event, seq=self._numbers(1)))
        self._socket.close()

    def _read_joins(self, due: dict[bytes, None]) -> None:
        """Add to `due` the snapshot topics subscribed to that ask this publisher (`_asks`), drop
        those unsubscribed from; reads at most `_MAX_JOINS_READ` messages, so a flood of them
        cannot hold the sender off its events, and keeps at most `_MAX_JOINS_PENDING` topics."""
        for _ in range(_MAX_JOINS_READ):
            if not self._socket.poll(0):
                return
            message = self._socket.recv()
            topic = message[1:]
            if not topic.startswith(SNAPSHOT_TOPIC_PREFIX) or not _asks(topic, self._identity):
                continue  # the live topic, another publisher's snapshot topic, anything else
            if message[:1] == b"\x00":  # an unsubscription: it left before its snapshot
                due.pop(topic, None)
            elif len(due) < _MAX_JOINS_PENDING:
                due[topic] = None

    def _send_snapshot(self, topics: Sequence[bytes]) -> None:
        """Send the snapshot on each of `topics` (nothing before events announced a tier)."""
        events = self._snapshot_events()
        if not events:
            return
        with self._lock:
            self._published += len(events) * len(topics)
        self._snapshots += len(topics)
        frames = [encode(event) for event in events]  # once, whatever the number of topics
        for topic in topics:
            for frame in frames:
                self._send_frame(topic, frame)

    def _snapshot_events(self) -> list[KVEvent]:
        """A cleared-event per tier of this replica's own listed whole, then the held blocks as
        stored-events; all numbered as the last event, sent or dropped, the holdings include."""
        self._record_journal()
        batches = self._holdings.snapshot(SNAPSHOT_CHUNK)
        own = [t for t in TIER_ORDER if t in self._own_tiers]
        cleared = [t for t in own if self._holdings.complete(t)]
        seq = self._held_seq

        def event(kind: EventKind, tier: Tier, hashes: tuple[BlockHash, ...]) -> KVEvent:
            return KVEvent(kind, self.replica, self.epoch, tier, hashes, seq)

        return [event(EventKind.CLEARED, t, ()) for t in cleared] + [
            event(EventKind.STORED, tier, hashes) for tier, hashes in batches
        ]

    def _record_journal(self) -> None:
        """Move the journal into the holdings (the sender thread's): the lock is held only to
        take the journal and the number of the last event it includes."""
        with self._lock:
            journal, self._journal = self._journal, []
            lost, self._journal_lost = self._journal_lost, False
            self._held_seq = max(0, self._seq + self._skipped - 1)
        for event in journal:
            self._holdings.apply(event)
            if event.tier is not Tier.L2:
                self._own_tiers.add(event.tier)
        if lost:
            self._holdings.mark_incomplete()

    def _numbers(self, n: int) -> int:
        """The first of `n` sequence numbers for events sent now, after those dropped."""
        with self._lock:
            first = self._seq + self._skipped
            self._seq, self._skipped = first + n, 0
        return first

    def _send(self, event: KVEvent) -> None:
        self._send_frame(TOPIC, encode(event))

    def _send_frame(self, topic: bytes, frame: bytes) -> None:
        try:
            self._socket.send_multipart([topic, frame])
        except zmq.ZMQError:
            with self._lock:
                self._dropped += 1

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(self._linger_s + 5.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventSubscriber:
    """Receives KV events from the publishers at `endpoints` (connects to each).

    Malformed frames are skipped and counted in `malformed`. ZMQ reconnects on its own when a
    replica restarts at the same endpoint. Events of a snapshot come with `snapshot` set.
    The join's snapshot topic names no publisher: each publisher, connected now or later, sends
    its snapshot; `resync` asks the publishers it names alone.
    """

    def __init__(
        self,
        endpoints: Sequence[str] = (),
        *,
        curve_server_key: bytes | str | None = None,
        resync_interval_s: float = RESYNC_MIN_INTERVAL_S,
    ) -> None:
        """`curve_server_key`: the publishers' Z85 CURVE public key (only publishers holding
        its secret half are heard, encrypted); None: plain events. `resync_interval_s`: the
        least time between two snapshot requests (`resync`), the join included; it doubles up
        to `RESYNC_MAX_INTERVAL_S` while resyncs follow each other as soon as it allows."""
        self._lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve_server_key is not None:
            key = curve_server_key
            if isinstance(key, str):
                key = key.encode()
            if len(key) != 40:
                raise ConfigError("events_curve_server_key: not a Z85 CURVE key (40 characters)")
            public, secret = zmq.curve_keypair()
            self._socket.curve_publickey = public
            self._socket.curve_secretkey = secret
            self._socket.curve_serverkey = key
        self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._topics: dict[bytes, _Asked] = {}
        """Where the publishers send this subscriber, and it alone, their snapshots: each
        snapshot topic subscribed to -> whom it asks, since when."""
        self._least_interval_s = resync_interval_s
        self._interval_s = resync_interval_s
        self._last_request = time.monotonic()
        self._listen(None, self._last_request)
        self._endpoints: list[str] = []
        self.malformed = 0
        for endpoint in endpoints:
            self.connect(endpoint)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    def connect(self, endpoint: str) -> None:
        """Also listen to `endpoint` (a replica added at run time)."""
        with self._lock:
            try:
                self._socket.connect(endpoint)
            except zmq.ZMQError as exc:
                raise ConfigError(f"events endpoint {endpoint!r}: {exc}") from exc
            self._endpoints.append(endpoint)

    def disconnect(self, endpoint: str) -> None:
        with self._lock:
            if endpoint in self._endpoints:
                self._socket.disconnect(endpoint)
                self._endpoints.remove(endpoint)

    def resync(self, publishers: Collection[PublisherId] = ()) -> bool:
        """Ask `publishers` (none given: every publisher) for a fresh snapshot (this subscriber
        missed their events): subscribe to a new snapshot topic naming each, leaving the topic
        it was asked on before, and the topics naming others that are over `NAMED_TOPIC_TTL_S`
        old. False, asking nothing, within the current interval of the last request; the
        interval doubles when this one comes within twice it (gaps go on), and is back to its
        least otherwise."""
        wanted: set[PublisherId | None] = set(publishers) or {None}
        with self._lock:
            now = time.monotonic()
            since = now - self._last_request
            if since < self._interval_s:
                return False
            gaps_go_on = since < 2 * self._interval_s
            doubled = min(RESYNC_MAX_INTERVAL_S, 2 * self._interval_s)
            self._interval_s = doubled if gaps_go_on else self._least_interval_s
            self._last_request = now
            for topic, asked in list(self._topics.items()):
                expired = asked.publisher is not None and now - asked.at > NAMED_TOPIC_TTL_S
                if asked.publisher in wanted or expired:
                    self._socket.setsockopt(zmq.UNSUBSCRIBE, topic)
                    del self._topics[topic]
            for publisher in wanted:
                self._listen(publisher, now)
        return True

    def _listen(self, publisher: PublisherId | None, now: float) -> None:
        """Subscribe to a new snapshot topic naming `publisher` (None: every one); under the
        lock, or before the subscriber is shared."""
        topic = _new_snapshot_topic(publisher)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._topics[topic] = _Asked(publisher, now)

    def recv(self, timeout_s: float | None = None) -> KVEvent | None:
        """The next event, or None when none arrives within `timeout_s` (None: wait forever)."""
        deadline = deadline_in(timeout_s)
        while True:
            remaining = seconds_left(deadline)
            with self._lock:  # parsed under it: `resync` may not switch topics in between
                timeout_ms = None if remaining is None else int(remaining * 1000)
                if not self._socket.poll(timeout_ms):
                    return None
                event = self._parse(self._socket.recv_multipart())
            if event is not None:
                return event
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def drain(self, max_events: int = 10_000, timeout_s: float = 0.0) -> list[KVEvent]:
        """Up to `max_events` events: waits up to `timeout_s` for the first, then takes only
        what is already queued."""
        events: list[KVEvent] = []
        first = self.recv(timeout_s)
        if first is None:
            return events
        events.append(first)
        while len(events) < max_events:
            event = self.recv(0.0)
            if event is None:
                break
            events.append(event)
        return events

    def _parse(self, frames: list[bytes]) -> KVEvent | None:
        if len(frames) != 2 or (frames[0] != TOPIC and frames[0] not in self._topics):
            self.malformed += 1
            return None
        try:
            event = decode(frames[1])
        except CodecError:
            self.malformed += 1
            return None
        return event if frames[0] == TOPIC else replace(event, snapshot=True)

    def close(self) -> None:
        with self._lock:
            self._socket.close(0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
