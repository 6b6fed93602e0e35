"""Replicas found by DNS, and tie-breaks that several routers agree on.

A Kubernetes headless Service's name resolves to the address of every ready pod behind it.
`Discovery` resolves `replicas_dns` (HOST:PORT) every `discovery_interval_s` and keeps the
router's `ReplicaSet` in step with the answer:

- a new address A is probed (`GET http://A:PORT/health`); once it answers 200 the replica
  `http://A:PORT` joins (named by that URL, as the connector of a pod names itself from its pod
  IP), is health-checked once more so the router learns its models and block size before
  routing to it, and its KV events (`tcp://A:replica_events_port`) and its engine's own
  (`tcp://A:replica_vllm_events_port`, vLLM's `--kv-events-config`; its gaps asked back from
  `tcp://A:replica_vllm_replay_port` when set) are followed;
- an address gone from the answer is drained: no new requests go to it, and it is dropped once
  its in-flight requests end (or after `drain_timeout_s`): removed from the set, purged from the
  index and the policy, its events no longer followed; one that comes back while draining is
  taken back at once.

A failed resolution (timeout, resolver failure) keeps the current set; only an answer, or
"no such name" (a Service with no ready pod), changes it. An empty answer (or "no such name")
that would take out every discovered replica still in rotation is acted on only when the next
round's answer is empty too: one bad answer (a DNS cache or an EndpointSlice being rewritten)
never empties the router, and a Service scaled to zero is drained one round later. Replicas
given statically (`replicas`) are never touched. A dead replica still listed (its node lost,
DNS not yet told) is the health checker's: it is excluded from routing after `unhealthy_after`
failed checks.

Several routers, one view: every router discovers the same replicas and follows all their
events, so their indexes agree; `ConsistentTies` makes the last free choice, the tie-break,
agree too (in-flight counts and recent-work history stay local to each router).

Owner: the router app; `run()` is one asyncio task, cancelled on shutdown. Resolution uses
the event loop's `getaddrinfo` (the system resolver: /etc/hosts, then DNS; nothing cached here).
It runs in a thread that a timeout cannot stop, so a resolution that outlives its round is
waited for again by the next rounds rather than joined by a new one: a DNS server that hangs
holds one thread, not one more per round.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import TypeVar

from kvtier.net.http_client import HttpPool
from kvtier.router.event_feed import EventFeed
from kvtier.router.replicas import Replica, ReplicaSet
from kvtier.router.settings import ReplicaSettings, RouterSettings

__all__ = ["ROUTE_KEY", "ConsistentTies", "Discovery", "resolve_addresses"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Resolve = Callable[[str, int], Awaitable[list[str]]]
"""resolve(host, port) -> addresses; raises OSError when the resolver fails."""

_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (sorted); [] when the name does not exist."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_NAME:
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class Discovery:
    """Keeps the discovered part of a `ReplicaSet` equal to what `replicas_dns` resolves to."""

    def __init__(
        self,
        config: RouterSettings,
        replicas: ReplicaSet,
        pool: HttpPool,
        check: Callable[[], Awaitable[None]],
        forget: Callable[[str, str], None],
        feed: EventFeed | None,
        clock: Callable[[], float],
        resolve: Resolve = resolve_addresses,
    ) -> None:
        """`check()` health-checks every replica; `forget(name, cause)` purges a replica."""
        assert config.replicas_dns is not None
        host, _, port = config.replicas_dns.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self._config = config
        self._replicas = replicas
        self._pool = pool
        self._check = check
        self._forget = forget
        self._feed = feed
        self._clock = clock
        self._resolve = resolve
        self._mine: dict[str, str | None] = {}
        """Replicas this discovery added -> their events endpoint."""
        self._drain_until: dict[str, float] = {}
        self._empty_once = False
        """The last answer was empty and was not acted on (it would have emptied the set)."""
        self._resolving: asyncio.Future[list[str]] | None = None
        """The resolution under way (it may outlive the round that started it)."""

    @property
    def discovered(self) -> list[str]:
        """Names of the replicas discovery added and still holds (draining ones included)."""
        return sorted(self._mine)

    async def run(self) -> None:
        """`sync` every `discovery_interval_s`; a round that fails unexpectedly is logged and
        the next one runs as usual."""
        while True:
            await asyncio.sleep(self._config.discovery_interval_s)
            try:
                await self.sync()
            except Exception:
                log.exception("discovery of %s: the round failed; trying again", self.host)

    async def sync(self) -> None:
        """One round: resolve, join new replicas, drain vanished ones, drop drained ones."""
        try:
            async with asyncio.timeout(max(1.0, self._config.discovery_interval_s)):
                addresses: list[str] | None = await asyncio.shield(self._resolution())
        except (OSError, TimeoutError) as exc:
            log.warning("cannot resolve %s (keeping %d replicas): %s", self.host, len(self), exc)
            addresses = None
        if addresses is not None:
            emptying = not addresses and self._mine.keys() - self._drain_until.keys()
            if emptying and not self._empty_once:
                log.warning(
                    "%s resolves to nothing: keeping %d replicas a round", self.host, len(self)
                )
                addresses = None
            self._empty_once = bool(emptying) and addresses is None
        if addresses is not None:
            wanted = {f"http://{_host(a)}:{self.port}": a for a in addresses}
            for name in self._mine.keys() - wanted.keys():
                self._drain(name)
            for name in wanted.keys() & self._drain_until.keys():
                self._undrain(name)
            new = [
                (name, a)
                for name, a in sorted(wanted.items())
                if name not in self._mine and name not in self._replicas.replicas
            ]
            joined = await asyncio.gather(*(self._join(name, a) for name, a in new))
            if any(joined):
                await self._check()  # learn their models and block size before routing there
        await self._drop_drained()

    def __len__(self) -> int:
        return len(self._mine)

    def _resolution(self) -> asyncio.Future[list[str]]:
        """The resolution under way, or a new one once the last has ended."""
        if self._resolving is None or self._resolving.done():
            self._resolving = asyncio.ensure_future(self._resolve(self.host, self.port))
            # (its outcome is read by whichever round awaits it, maybe none)
            self._resolving.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._resolving

    async def _join(self, name: str, address: str) -> bool:
        if not await self._healthy(name):
            return False
        self._replicas.add(ReplicaSettings(url=name), healthy=False)
        endpoint = None
        if self._config.replica_events_port is not None:
            endpoint = f"tcp://{_host(address)}:{self._config.replica_events_port}"
            if self._feed is not None:
                await self._feed.connect(endpoint)
        vllm_port = self._config.replica_vllm_events_port
        replay_port = self._config.replica_vllm_replay_port
        if vllm_port is not None and self._feed is not None:
            replay = None if replay_port is None else f"tcp://{_host(address)}:{replay_port}"
            self._feed.connect_vllm(name, f"tcp://{_host(address)}:{vllm_port}", replay)
        self._mine[name] = endpoint
        log.info("replica %s joined", name)
        return True

    async def _healthy(self, url: str) -> bool:
        try:
            async with asyncio.timeout(self._config.health_timeout_s):
                resp = await self._pool.get(url, "/health")
                resp.close()
        except (TimeoutError, OSError):
            return False
        return resp.status == 200

    def _drain(self, name: str) -> None:
        replica = self._replicas.replicas.get(name)
        if replica is None or replica.draining:
            return
        replica.draining = True
        self._drain_until[name] = self._clock() + self._config.drain_timeout_s
        log.info("replica %s left the service: draining %d requests", name, replica.in_flight)

    def _undrain(self, name: str) -> None:
        self._drain_until.pop(name, None)
        replica = self._replicas.replicas.get(name)
        if replica is not None:
            replica.draining = False
            log.info("replica %s is back", name)

    async def _drop_drained(self) -> None:
        now = self._clock()
        for name, until in list(self._drain_until.items()):
            replica: Replica | None = self._replicas.replicas.get(name)
            if replica is not None and replica.in_flight > 0 and now < until:
                continue
            del self._drain_until[name]
            endpoint = self._mine.pop(name, None)
            self._replicas.remove(name)
            if self._feed is not None:  # (first: a batch applied meanwhile outlives the purge)
                await self._feed.disconnect_vllm(name)
                if endpoint is not None:
                    await self._feed.disconnect(endpoint)
            self._forget(name, "gone")
            log.info("replica %s dropped", name)


ROUTE_KEY: ContextVar[bytes | None] = ContextVar("kvtier_route_key", default=None)
"""The request being routed, as bytes (its last prompt block hash); set by the router."""


class ConsistentTies(random.Random):
    """A tie-break several routers agree on: among tied replicas, the one with the highest
    hash of (`ROUTE_KEY`, replica name), i.e. rendezvous hashing. Keyed by the prompt's last
    block, siblings and distinct prompts spread over replicas (no "first wins" hot spot), and a
    replica joining or leaving moves only the ties it wins or held. A request without a key
    (shorter than one block) falls back to the seeded generator."""

    def choice(self, seq: Sequence[T]) -> T:  # type: ignore[override]
        key = ROUTE_KEY.get()
        if key is None or len(seq) < 2:
            return super().choice(seq)
        return max(
            seq, key=lambda item: hashlib.blake2b(key + str(item).encode(), digest_size=8).digest()
        )
