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

Callers and threads:
- `EventPublisher.publish` is called from any thread (the connector's store callbacks run on the
  scheduler thread and on L2 I/O threads); it only enqueues. One sender thread owned by the
  publisher holds the socket (ZMQ sockets are not thread-safe). A full queue drops the event and
  counts it; publishing never blocks the engine.
- `EventSubscriber.recv` / `drain` may be called from any thread; a lock serialises socket use.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import zmq

from kvtier.core.errors import CodecError, ConfigError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import HASH_BYTES, BlockHash
from kvtier.core.tiers.base import Tier

__all__ = [
    "TOPIC",
    "WIRE_VERSION",
    "EventPublisher",
    "EventSubscriber",
    "decode",
    "encode",
    "new_epoch",
]

TOPIC = b"kvtier.kv"
WIRE_VERSION = 1


def new_epoch() -> str:
    """A random id for one process lifetime of a replica."""
    return secrets.token_hex(8)


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
    """Parse one JSON frame; raises `CodecError` for anything malformed."""
    try:
        doc: dict[str, Any] = json.loads(data)
        if doc["v"] != WIRE_VERSION:
            raise CodecError(f"event wire version {doc['v']!r}, expected {WIRE_VERSION}")
        hashes = tuple(BlockHash(bytes.fromhex(h)) for h in doc["hashes"])
        if any(len(h) != HASH_BYTES for h in hashes):
            raise CodecError(f"event hash not {HASH_BYTES} bytes")
        seq = doc["seq"]
        if not isinstance(seq, int):
            raise CodecError(f"event seq {seq!r} is not an integer")
        return KVEvent(
            kind=EventKind(doc["kind"]),
            replica=str(doc["replica"]),
            epoch=str(doc["epoch"]),
            tier=Tier(doc["tier"]),
            hashes=hashes,
            seq=seq,
        )
    except CodecError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"malformed KV event: {exc}") from exc


class EventPublisher:
    """Publishes one replica's KV events on a bound ZMQ PUB socket.

    `publish(kind, tier, hashes)` stamps replica, epoch and a sequence number and enqueues;
    `close()` sends what is queued (up to `linger_s`) and stops the sender thread.
    """

    def __init__(
        self,
        endpoint: str,
        replica: str,
        *,
        epoch: str | None = None,
        max_queue: int = 10_000,
        linger_s: float = 1.0,
    ) -> None:
        if not endpoint:
            raise ConfigError("events_endpoint: must not be empty")
        if not replica:
            raise ConfigError("replica: must not be empty")
        if max_queue <= 0:
            raise ConfigError(f"max_queue: must be positive, got {max_queue}")
        self.endpoint = endpoint
        self.replica = replica
        self.epoch = epoch or new_epoch()
        self._linger_s = linger_s
        self._queue: queue.Queue[KVEvent | None] = queue.Queue(max_queue)
        self._lock = threading.Lock()
        self._seq = 0
        self._dropped = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, int(linger_s * 1000))
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
        """Sequence numbers handed out so far (events accepted or dropped)."""
        return self._seq

    def publish(self, kind: EventKind, tier: Tier, hashes: Sequence[BlockHash]) -> None:
        """Enqueue one event; never blocks (a full queue drops it, leaving a `seq` gap)."""
        with self._lock:
            event = KVEvent(
                kind=kind,
                replica=self.replica,
                epoch=self.epoch,
                tier=tier,
                hashes=tuple(hashes),
                seq=self._seq,
            )
            self._seq += 1
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self._dropped += 1

    def _send_loop(self) -> None:
        # Only this thread touches the socket after construction.
        while True:
            event = self._queue.get()
            if event is None:
                break
            try:
                self._socket.send_multipart([TOPIC, encode(event)])
            except zmq.ZMQError:
                with self._lock:
                    self._dropped += 1
        self._socket.close()

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
    replica restarts at the same endpoint.
    """

    def __init__(self, endpoints: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
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

    def recv(self, timeout_s: float | None = None) -> KVEvent | None:
        """The next event, or None when none arrives within `timeout_s` (None: wait forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._lock:
                timeout_ms = None if remaining is None else int(remaining * 1000)
                if not self._socket.poll(timeout_ms):
                    return None
                frames = self._socket.recv_multipart()
            event = self._parse(frames)
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
        if len(frames) != 2 or frames[0] != TOPIC:
            self.malformed += 1
            return None
        try:
            return decode(frames[1])
        except CodecError:
            self.malformed += 1
            return None

    def close(self) -> None:
        with self._lock:
            self._socket.close(0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
