"""Replica discovery by DNS: real fake replicas on their own loopback addresses (one port,
as pods behind a headless Service), real health checks, real KV events; only the resolver's
answer is scripted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import zmq

from kvtier.core.events import EventKind
from kvtier.core.keys import BlockHash, block_hashes
from kvtier.core.tiers.base import Tier
from kvtier.net.http_client import HttpPool
from kvtier.net.kv_events import EventPublisher
from kvtier.net.ports import free_port
from kvtier.router.app import Router, serving
from kvtier.router.discovery import Discovery
from kvtier.router.event_feed import EventFeed
from kvtier.router.health import HealthChecker
from kvtier.router.index import PrefixIndex
from kvtier.router.replicas import ReplicaSet
from kvtier.router.settings import RouterSettings
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.fake_replica import FakeReplica
from tests.helpers.aio import run

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


class Dns:
    """A scripted resolver: `answer` is what the name resolves to; `error` fails the lookup."""

    def __init__(self) -> None:
        self.answer: list[str] = []
        self.error: OSError | None = None

    async def __call__(self, host: str, port: int) -> list[str]:
        if self.error is not None:
            raise self.error
        return list(self.answer)


@asynccontextmanager
async def pods(port: int) -> AsyncIterator[dict[str, FakeReplica]]:
    started = {
        a: await FakeReplica(model="smol", block_tokens=16).start(a, port) for a in ADDRESSES
    }
    try:
        yield started
    finally:
        for fake in started.values():
            await fake.stop()


def test_replicas_join_after_health_drain_and_leave_with_their_events() -> None:
    async def scenario() -> None:
        port, events_port = free_port(), free_port()
        url = {a: f"http://{a}:{port}" for a in ADDRESSES}
        config = RouterSettings(
            replicas_dns=f"kvtier-replicas:{port}",
            replica_events_port=events_port,
            health_timeout_s=1.0,
            drain_timeout_s=30.0,
        )
        replicas = ReplicaSet(())
        index = PrefixIndex()
        forgotten: list[tuple[str, str]] = []

        def forget(name: str, cause: str) -> None:
            forgotten.append((name, cause))
            index.purge(name)

        pool = HttpPool(1.0, 5.0)
        health = HealthChecker(pool, replicas, 1.0, 1.0, 2, lambda n: forget(n, "down"))
        feed = EventFeed(index, (), {}, lambda *_: None, lambda: 0.0, 1000, dynamic=True)
        feed.start()
        dns = Dns()
        discovery = Discovery(
            config, replicas, pool, health.check_all, forget, feed, lambda: clock, resolve=dns
        )
        clock = 0.0
        publisher = EventPublisher(f"tcp://{ADDRESSES[1]}:{events_port}", url[ADDRESSES[1]])
        try:
            async with pods(port) as fakes:
                fakes[ADDRESSES[1]].healthy = False
                dns.answer = list(ADDRESSES[:2])
                await discovery.sync()
                # the unhealthy one is not added; the healthy one joins and is checked at once
                assert [r.name for r in replicas] == [url[ADDRESSES[0]]]
                assert replicas[url[ADDRESSES[0]]].healthy
                assert replicas[url[ADDRESSES[0]]].block_tokens == 16  # learned before routing

                fakes[ADDRESSES[1]].healthy = True
                await discovery.sync()
                assert sorted(r.name for r in replicas) == [url[a] for a in ADDRESSES[:2]]
                # its KV events are followed from now on
                block = BlockHash(bytes(16))
                for _ in range(50):  # a new ZMQ subscription takes a moment to connect
                    publisher.publish(EventKind.STORED, Tier.L1, [block])
                    await asyncio.sleep(0.1)
                    if index.match([block]):
                        break
                assert index.match([block]) == {url[ADDRESSES[1]]: [Tier.L1]}

                # gone from DNS while a request runs there: drained, not dropped
                dns.answer = [ADDRESSES[0]]
                claim = replicas.claim(replicas[url[ADDRESSES[1]]], 0)
                await discovery.sync()
                assert replicas[url[ADDRESSES[1]]].draining
                views = {v.name: v.healthy for v in replicas.views(set())}
                assert views == {url[ADDRESSES[0]]: True, url[ADDRESSES[1]]: False}
                claim.release()
                await discovery.sync()
                assert [r.name for r in replicas] == [url[ADDRESSES[0]]]
                assert (url[ADDRESSES[1]], "gone") in forgotten
                assert index.match([block]) == {}  # purged

                # a failed lookup keeps what is known; two empty answers drain everything
                dns.error = OSError("temporary failure in name resolution")
                await discovery.sync()
                assert len(replicas) == 1
                dns.error = None
                dns.answer = [ADDRESSES[2], ADDRESSES[0]]
                await discovery.sync()
                assert len(replicas) == 2 and discovery.discovered == [
                    url[ADDRESSES[0]],
                    url[ADDRESSES[2]],
                ]
                dns.answer = []
                stuck = replicas.claim(replicas[url[ADDRESSES[2]]], 0)
                await discovery.sync()
                assert len(replicas) == 2  # one empty answer alone changes nothing
                await discovery.sync()
                assert [r.name for r in replicas] == [url[ADDRESSES[2]]]  # draining
                clock = 31.0  # past drain_timeout_s: dropped even with a request held
                await discovery.sync()
                assert len(replicas) == 0
                stuck.release()
        finally:
            publisher.close()
            await feed.close()
            pool.close()

    run(scenario(), timeout_s=60)


def test_a_discovered_replicas_vllm_events_feed_l0_under_its_name() -> None:
    """`replica_vllm_events_port`: the engine's own KV events (vLLM's `--kv-events-config`
    publisher) of a replica discovery added are followed under the replica's name, and no
    longer once it is dropped."""

    async def scenario() -> None:
        port, vllm_port = free_port(), free_port()
        address = ADDRESSES[0]
        name = f"http://{address}:{port}"
        config = RouterSettings(
            replicas_dns=f"kvtier-replicas:{port}",
            replica_vllm_events_port=vllm_port,
            health_timeout_s=1.0,
            drain_timeout_s=30.0,
        )
        replicas = ReplicaSet(())
        index = PrefixIndex()
        pool = HttpPool(1.0, 5.0)
        health = HealthChecker(pool, replicas, 1.0, 1.0, 2, lambda n: index.purge(n))
        feed = EventFeed(index, (), {}, lambda *_: None, lambda: 0.0, 1000, dynamic=True)
        feed.start()
        dns = Dns()
        discovery = Discovery(
            config,
            replicas,
            pool,
            health.check_all,
            lambda n, c: index.purge(n),
            feed,
            lambda: 0.0,
            resolve=dns,
        )
        engine = zmq.Context.instance().socket(zmq.PUB)  # what vLLM binds: tcp://*:PORT
        engine.setsockopt(zmq.LINGER, 0)
        engine.bind(f"tcp://{address}:{vllm_port}")
        tokens = list(range(32))
        stored = {
            "type": "BlockStored",
            "block_hashes": [11, 12],
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        hashes = block_hashes(tokens, 16)
        try:
            async with pods(port):
                dns.answer = [address]
                await discovery.sync()
                assert [r.name for r in replicas] == [name]
                for seq in range(50):  # a new ZMQ subscription takes a moment to connect
                    batch = msgspec.msgpack.encode([0.0, [stored], None])
                    engine.send_multipart([b"", seq.to_bytes(8, "big"), batch])
                    await asyncio.sleep(0.1)
                    if index.match(hashes):
                        break
                assert index.match(hashes) == {name: [Tier.L0, Tier.L0]}
                dns.answer = []
                await discovery.sync()  # one empty answer alone changes nothing
                assert len(replicas) == 1
                await discovery.sync()  # drained, and dropped (no request in flight)
                assert len(replicas) == 0 and index.match(hashes) == {}
                engine.send_multipart([b"", (99).to_bytes(8, "big"), batch])
                await asyncio.sleep(0.3)
                assert index.match(hashes) == {}  # no longer followed
        finally:
            engine.close(0)
            await feed.close()
            pool.close()

    run(scenario(), timeout_s=60)


def test_router_serves_replicas_it_found_by_name(tokenizer: Tokenizer) -> None:
    """End to end through the Router: `localhost` resolves like a one-pod Service."""

    async def scenario() -> None:
        port = free_port()
        fake = await FakeReplica(model="smol", block_tokens=16).start("127.0.0.1", port)
        config = RouterSettings(
            replicas_dns=f"localhost:{port}", discovery_interval_s=0.2, health_interval_s=0.2
        )
        router = Router(config, tokenizer=tokenizer)
        try:
            async with serving(router, "127.0.0.1", 0) as listening, httpx.AsyncClient() as client:
                body = {"model": "smol", "prompt": "hello " * 40, "max_tokens": 2}
                resp = await client.post(listening.url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-kvtier-replica"] == f"http://127.0.0.1:{port}"
                health = (await client.get(listening.url + "/health")).json()
                assert health["replicas"] >= 1
        finally:
            await fake.stop()

    run(scenario(), timeout_s=60)


def test_consistent_ties_agree_across_routers_and_spread_over_replicas() -> None:
    from kvtier.router.discovery import ROUTE_KEY, ConsistentTies

    names = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    one, other = ConsistentTies(1), ConsistentTies(2)
    picks = []
    token = ROUTE_KEY.set(None)
    try:
        for i in range(300):
            ROUTE_KEY.set(i.to_bytes(16, "big"))
            pick = one.choice(names)
            assert other.choice(list(reversed(names))) == pick  # same key, same replica
            picks.append(pick)
        assert all(picks.count(n) > 60 for n in names)  # no "first wins" hot spot
        ROUTE_KEY.set(None)  # no key (a prompt shorter than a block): the seeded generator
        assert {ConsistentTies(s).choice(names) for s in range(20)} == set(names)
    finally:
        ROUTE_KEY.reset(token)
