"""KV events into the `kvaware` index: kvtier connector events (L1/L2) and vLLM's own (L0).

Two sources:
- kvtier connector events (`kvtier.net.kv_events`, JSON over ZMQ): already named by kvtier hashes.
  A new `epoch` for a replica means it restarted: the tiers its connector announced for it (L1)
  are purged first; the shared pool's L2 entries stay (they outlive the replica).
  A jump in a replica's `seq` means events were lost (its publisher's queue was full, or this
  subscriber was slow): counted as a `gap`, and repaired by a resync (`EventSubscriber.resync`,
  `count("kvtier", "resync")` once per request): each replica whose events had gaps since the
  last resync (by replica and epoch), and it alone, sends a fresh snapshot, whose
  cleared-events drop the entries of the replica's own tiers that lost removals left stale and
  whose stored-events restore what lost stores left out. One resync at most per
  `RESYNC_MIN_INTERVAL_S`: the replicas with a gap seen within it are named by the next one.
  A snapshot's events are no gap, whatever their `seq` (they stand for everything up to it).
  Until then, and for what a resync cannot repair (L2 entries another replica's janitor
  removed), a stale entry costs a routing miss, never wrong output.
  L2 blocks are stored under the pseudo-replica `SHARED` (they count for every replica).
- vLLM's `--kv-events-config` publisher (msgpack `KVEventBatch` over ZMQ, frames topic, seq,
  payload). Its block hashes are seeded per process, so `VllmRehasher` re-hashes each stored
  block from the event's token ids, chaining by parent hash per replica, into kvtier hashes (a
  LoRA adapter's blocks from the adapter's own root, by the event's `lora_name`; salted or
  multimodal blocks cannot be named: their extra keys are published untagged). A sequence
  number going backwards means the engine restarted: its L0 entries (and any tier its events
  announced, e.g. vLLM's own CPU offloading as L1) are purged. `AllBlocksCleared` (vLLM's
  `/reset_prefix_cache`) drops the replica's L0 entries only: it clears vLLM's cache, not
  kvtier's L1. A jump in the sequence means batches were lost (a network blip, the PUB
  socket's high-water mark): a lost parent leaves every descendant unnamed. Given the
  publisher's replay endpoint (its `replay_endpoint`, a ROUTER), the replica's loop asks it for
  the batches after the last applied (DEALER: b"", start seq; answers b"", topic, seq, payload,
  then seq -1 to end) and applies those before the live batch, in order, then the live batch;
  one replay at a time (the loop is sequential: the SUB socket queues meanwhile), at most
  `REPLAY_MAX_BATCHES` batches within `REPLAY_TIMEOUT_S`. Counted: `replayed` per batch filled,
  `replay_failed` per replay that failed or timed out, and `gap` per jump still left when a
  batch is applied (batches lost for good: no replay endpoint, the replay failed, or vLLM's
  buffer no longer held them).

Each source purges only its own tiers: the two see one restart at different times (the
connector's new epoch may come first, the engine's first event long after), and a source
purging the whole replica would wipe what the other had just announced. A restart is counted as
`count(source, "restart")`. A restart purge also drops the router's own guesses (speculative
entries) of the same replica in those tiers (`PrefixIndex.remove_tier`).

`KvtierApplier` and `VllmRehasher` are pure (state in, index mutations out) and unit-tested
without sockets; `EventFeed` owns the sockets and one asyncio task per source.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import BlockHash, chain_hash, extra_key, root_hash
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import RESYNC_MIN_INTERVAL_S, EventSubscriber, PublisherId
from kvtier.router.index import SHARED, PrefixIndex

__all__ = ["REPLAY_MAX_BATCHES", "REPLAY_TIMEOUT_S", "EventFeed", "KvtierApplier", "VllmRehasher"]

log = logging.getLogger(__name__)

Count = Callable[[str, str], None]
"""count(source, kind): one event applied."""


class KvtierApplier:
    """Applies kvtier connector events to the index; on a replica's new epoch, first drops the
    tiers its connector announced (`count("kvtier", "restart")`).

    `known(replica)` is the allow-list: an event naming a replica the router does not serve
    (a stray or forged publisher) is ignored, so it can neither fill the index nor purge a
    real replica's entries. `count("kvtier", "gap")` and then `on_gap(publisher)` (the event's
    replica and epoch) are called for each jump in a replica's `seq` (events lost before this
    one); a snapshot's event is no jump: it re-announces the replica's holdings as of its
    `seq`."""

    def __init__(
        self,
        index: PrefixIndex,
        known: Callable[[str], bool] | None = None,
        count: Count = lambda source, kind: None,
        on_gap: Callable[[PublisherId], None] = lambda publisher: None,
    ) -> None:
        self._index = index
        self._known = known
        self._count = count
        self._on_gap = on_gap
        self._epochs: dict[str, str] = {}
        self._next_seq: dict[str, int] = {}
        self._tiers: dict[str, set[Tier]] = {}
        """replica -> the tiers its connector announced for it alone (L2 is the pool's)."""

    def apply(self, event: KVEvent, now: float) -> bool:
        """Apply `event`; False when it was ignored (an unknown replica)."""
        if self._known is not None and not self._known(event.replica):
            return False
        known = self._epochs.get(event.replica)
        if known is not None and known != event.epoch:
            for tier in self._tiers.get(event.replica, ()):
                self._index.remove_tier(event.replica, tier)
            self._count("kvtier", "restart")
        elif not event.snapshot and event.seq > self._next_seq.get(event.replica, event.seq):
            self._count("kvtier", "gap")
            self._on_gap(PublisherId(event.replica, event.epoch))
        self._epochs[event.replica] = event.epoch
        self._next_seq[event.replica] = event.seq + 1
        holder = SHARED if event.tier is Tier.L2 else event.replica
        if holder != SHARED:
            self._tiers.setdefault(holder, set()).add(event.tier)
        if event.kind is EventKind.STORED:
            self._index.insert(holder, event.hashes, event.tier, now)
        elif event.kind is EventKind.REMOVED:
            self._index.remove(holder, event.hashes, event.tier)
        elif holder == SHARED:
            self._index.purge(SHARED)
        else:
            self._index.remove_tier(holder, event.tier)
        return True


_MEDIUM_TIER = {None: Tier.L0, "GPU": Tier.L0, "CPU": Tier.L1}


class VllmRehasher:
    """Turns one replica's vLLM KV event batches into index updates under kvtier hashes.

    `max_blocks` bounds the vLLM-hash -> kvtier-hash map (LRU); a stored block whose parent is
    no longer mapped cannot be named and is skipped (counted in `unnamed`).
    """

    def __init__(
        self,
        replica: str,
        index: PrefixIndex,
        max_blocks: int = 1_000_000,
        adapter_path: Callable[[str], str | None] = lambda name: None,
    ) -> None:
        """`adapter_path(name)`: the path of the replica's LoRA adapter `name` (None: unknown;
        its blocks cannot be named: the events name the adapter, not its path)."""
        self.replica = replica
        self._adapter_path = adapter_path
        self._index = index
        self._max_blocks = max_blocks
        self._names: OrderedDict[object, BlockHash] = OrderedDict()
        self._tiers = {Tier.L0}
        """The tiers this replica's vLLM events announce (L0, and L1 for vLLM's CPU offload)."""
        self._last_seq: int | None = None
        self.unnamed = 0

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the last batch applied (None: none yet)."""
        return self._last_seq

    def apply(self, seq: int, payload: bytes, now: float, count: Count) -> None:
        """Apply batch `seq`. A `seq` at or below the last one means the engine restarted: the
        replica's tiers announced by these events are purged first (`count("vllm",
        "restart")`); one beyond the next means batches were lost for good before it
        (`count("vllm", "gap")`: their blocks, and every descendant, stay unnamed)."""
        if self._last_seq is not None and seq <= self._last_seq:
            self._names.clear()
            for tier in self._tiers:
                self._index.remove_tier(self.replica, tier)
            count("vllm", "restart")
        elif self._last_seq is not None and seq > self._last_seq + 1:
            count("vllm", "gap")
        self._last_seq = seq
        batch = msgspec.msgpack.decode(payload)
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            count("vllm", "malformed")
            return
        for event in batch[1]:
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "BlockStored":
                self._stored(event, now)
            elif kind == "BlockRemoved":
                self._removed(event)
            elif kind == "AllBlocksCleared":
                self._names.clear()
                self._index.remove_tier(self.replica, Tier.L0)
            else:
                kind = "malformed"
            count("vllm", str(kind))

    def _stored(self, event: dict[str, Any], now: float) -> None:
        tier = _MEDIUM_TIER.get(event.get("medium"))
        hashes: Sequence[object] = event.get("block_hashes") or ()
        tokens: Sequence[int] = event.get("token_ids") or ()
        size = event.get("block_size")
        lora = event.get("lora_name")
        path = self._adapter_path(lora) if isinstance(lora, str) else None
        if (
            (lora is not None and path is None)
            or tier is None
            or not isinstance(size, int)
            or size <= 0
            or len(tokens) < size * len(hashes)
            or not _lora_only(event.get("extra_keys"), lora)
        ):
            self.unnamed += len(hashes)  # salted/multimodal, unknown adapter, foreign tier
            return
        parent_ext = event.get("parent_block_hash")
        if parent_ext is None:  # a LoRA adapter's chain starts at its own root, as the connector's
            parent = root_hash(extra_key(lora=lora, lora_path=path))
        elif _key(parent_ext) in self._names:
            parent = self._names[_key(parent_ext)]
        else:
            self.unnamed += len(hashes)
            return
        self._tiers.add(tier)
        named: list[BlockHash] = []
        for i, ext in enumerate(hashes):
            parent = chain_hash(parent, tokens[i * size : (i + 1) * size])
            self._names[_key(ext)] = parent
            self._names.move_to_end(_key(ext))
            named.append(parent)
        while len(self._names) > self._max_blocks:
            self._names.popitem(last=False)
        self._index.insert(self.replica, named, tier, now)

    def _removed(self, event: dict[str, Any]) -> None:
        tier = _MEDIUM_TIER.get(event.get("medium"))
        if tier is None:
            return
        named = [
            self._names.pop(_key(ext))
            for ext in event.get("block_hashes") or ()
            if _key(ext) in self._names
        ]
        self._index.remove(self.replica, named, tier)


def _lora_only(extra: object, lora: object) -> bool:
    """Whether a stored event's blocks are keyed by nothing but its LoRA adapter (or nothing):
    vLLM 0.32 publishes each block's extra keys untagged, the adapter's name first, then
    multimodal pairs, the cache salt and prompt-embeds digests (`to_event_extra_keys`)."""
    if lora is not None and not isinstance(lora, str):
        return False
    if not extra:
        return True
    if not isinstance(extra, list):
        return False
    alone = [lora] if lora is not None else []
    return all(not keys or (isinstance(keys, list) and keys == alone) for keys in extra)


def _key(ext: object) -> object:
    """vLLM external hashes are bytes or int; lists (msgpack of tuples) become tuples."""
    return tuple(ext) if isinstance(ext, list) else ext


REPLAY_TIMEOUT_S = 1.0
"""Longest one gap's replay may take, all its batches together."""
REPLAY_MAX_BATCHES = 10_000
"""Most batches one replay reads (vLLM keeps its last 10,000: `buffer_steps`)."""
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of vLLM's end-of-replay marker."""


@dataclass
class _VllmSource:
    """One replica's vLLM events: the live SUB socket, its rehasher, its replay endpoint."""

    sock: zmq.asyncio.Socket
    rehasher: VllmRehasher
    replay: str | None


class EventFeed:
    """Owns the event sockets; `start()` spawns the tasks, `close()` stops them."""

    def __init__(
        self,
        index: PrefixIndex,
        kvtier_endpoints: Sequence[str],
        vllm_endpoints: dict[str, str],
        count: Count,
        clock: Callable[[], float],
        max_blocks: int,
        dynamic: bool = False,
        *,
        known: Callable[[str], bool] | None = None,
        curve_server_key: str | None = None,
        adapter_path: Callable[[str, str], str | None] = lambda replica, name: None,
        vllm_replay: Mapping[str, str] | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        max_replay: int = REPLAY_MAX_BATCHES,
        resync_interval_s: float = RESYNC_MIN_INTERVAL_S,
    ) -> None:
        """`dynamic`: endpoints may join later (`connect`), even with none at start. `known`:
        the replicas whose kvtier events are accepted (None: any); `curve_server_key`: the
        publishers' CURVE public key (`kvtier.net.kv_events`); `adapter_path(replica, name)`:
        the path of a replica's LoRA adapter (`VllmRehasher`). `vllm_replay`: replica -> the
        replay endpoint of its vLLM publisher, asked for the batches of a gap (at most
        `max_replay` of them, within `replay_timeout_s`). `resync_interval_s`: the least time
        between two snapshot requests on kvtier gaps (`EventSubscriber.resync`)."""
        self._index = index
        self._clock = clock
        self._count = count
        self._kvtier = KvtierApplier(index, known, count, self._gap_seen)
        self._resync_due: set[PublisherId] = set()
        """The publishers whose events had gaps since the last resync request."""
        self._subscriber = (
            EventSubscriber(
                kvtier_endpoints,
                curve_server_key=curve_server_key,
                resync_interval_s=resync_interval_s,
            )
            if kvtier_endpoints or dynamic
            else None
        )
        self._ctx = zmq.asyncio.Context.instance()
        self._max_blocks = max_blocks
        self._adapter_path = adapter_path
        self._replay_timeout_s = replay_timeout_s
        self._max_replay = max_replay
        self._vllm: dict[str, _VllmSource] = {}
        self._vllm_tasks: dict[str, asyncio.Task[None]] = {}
        for replica, endpoint in vllm_endpoints.items():
            self._add_vllm(replica, endpoint, (vllm_replay or {}).get(replica))
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False

    def start(self) -> None:
        self._started = True
        if self._subscriber is not None:
            self._tasks.append(asyncio.create_task(self._kvtier_loop(self._subscriber)))
        for replica in self._vllm:
            self._start_vllm(replica)

    def connect_vllm(self, replica: str, endpoint: str, replay: str | None = None) -> None:
        """Also follow `replica`'s vLLM KV events published at `endpoint` (a replica that
        joined), repairing gaps from its publisher's `replay` endpoint if given; a replica
        already followed is left as it is."""
        if replica not in self._vllm:
            self._add_vllm(replica, endpoint, replay)
            if self._started:
                self._start_vllm(replica)

    async def disconnect_vllm(self, replica: str) -> None:
        """Stop following `replica`'s vLLM KV events (a replica that left)."""
        task = self._vllm_tasks.pop(replica, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        followed = self._vllm.pop(replica, None)
        if followed is not None:
            followed.sock.close(0)

    def _add_vllm(self, replica: str, endpoint: str, replay: str | None) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        paths = functools.partial(self._adapter_path, replica)
        rehasher = VllmRehasher(replica, self._index, self._max_blocks, paths)
        self._vllm[replica] = _VllmSource(sock, rehasher, replay)

    def _start_vllm(self, replica: str) -> None:
        self._vllm_tasks[replica] = asyncio.create_task(self._vllm_loop(self._vllm[replica]))

    async def connect(self, endpoint: str) -> None:
        """Also follow the kvtier events published at `endpoint` (a replica that joined)."""
        if self._subscriber is None:
            raise RuntimeError("EventFeed(dynamic=True) is required to connect endpoints later")
        await asyncio.to_thread(self._subscriber.connect, endpoint)  # waits out a drain's poll

    async def disconnect(self, endpoint: str) -> None:
        """Stop following `endpoint` (a replica that left)."""
        if self._subscriber is not None:
            await asyncio.to_thread(self._subscriber.disconnect, endpoint)

    async def _kvtier_loop(self, subscriber: EventSubscriber) -> None:
        while True:
            # the subscriber blocks (it is thread-safe); poll it off the event loop
            events = await asyncio.to_thread(subscriber.drain, 10_000, 0.2)
            for event in events:
                applied = self._kvtier.apply(event, self._clock())
                self._count("kvtier", event.kind.value if applied else "foreign")
            self._resync(subscriber)

    def _gap_seen(self, publisher: PublisherId) -> None:
        self._resync_due.add(publisher)

    def _resync(self, subscriber: EventSubscriber) -> None:
        """After gaps, ask the publishers that had them for fresh snapshots as soon as the
        subscriber's rate limit allows (`count("kvtier", "resync")` once per request, whatever
        the number of publishers it names)."""
        if self._resync_due and subscriber.resync(self._resync_due):
            self._resync_due.clear()
            self._count("kvtier", "resync")

    async def _vllm_loop(self, source: _VllmSource) -> None:
        """Apply the live batches in order; a gap before one is first repaired by replay (the
        SUB socket queues the batches that arrive meanwhile)."""
        while True:
            frames = await source.sock.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self._count("vllm", "malformed")
                continue
            seq = int.from_bytes(frames[1], "big")
            last = source.rehasher.last_seq
            if source.replay is not None and last is not None and seq > last + 1:
                await self._replay(source.rehasher, source.replay, last, seq)
            self._apply_vllm(source.rehasher, seq, frames[2])

    def _apply_vllm(self, rehasher: VllmRehasher, seq: int, payload: bytes) -> None:
        try:
            rehasher.apply(seq, payload, self._clock(), self._count)
        except Exception as exc:  # whatever a malformed batch raises: skip it, keep the feed
            log.warning("bad vLLM KV event batch from %s: %r", rehasher.replica, exc)
            self._count("vllm", "malformed")

    async def _replay(self, rehasher: VllmRehasher, endpoint: str, last: int, until: int) -> None:
        """Fill the gap between batches `last` (applied) and `until` (not yet): ask vLLM's
        replay `endpoint` (a ROUTER) for the batches from `last + 1` on and apply, in order,
        those strictly between the two (`count("vllm", "replayed")` each); others are skipped.
        Bounded by `replay_timeout_s` and `max_replay` batches read. A replay that fails or
        times out is counted as `replay_failed`; whatever it left unfilled is then counted as a
        `gap` by `VllmRehasher.apply`. Raises nothing but cancellation."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            async with asyncio.timeout(self._replay_timeout_s):
                sock.connect(endpoint)
                await sock.send_multipart([b"", (last + 1).to_bytes(8, "big")])
                for _ in range(self._max_replay):
                    frames = await sock.recv_multipart()  # b"", topic, seq, payload
                    if len(frames) != 4 or len(frames[2]) != 8 or frames[2] == _END_SEQ:
                        return
                    seq = int.from_bytes(frames[2], "big")
                    if seq >= until:
                        return
                    if seq > last:
                        self._apply_vllm(rehasher, seq, frames[3])
                        self._count("vllm", "replayed")
                        last = seq
                    if last == until - 1:
                        return
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("replay of %s's vLLM KV events failed: %r", rehasher.replica, exc)
            self._count("vllm", "replay_failed")
        finally:
            sock.close(0)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._vllm_tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._vllm_tasks.clear()
        for source in self._vllm.values():
            source.sock.close(0)
        self._vllm.clear()
        if self._subscriber is not None:
            self._subscriber.close()
