"""Pods come and go: one bad DNS answer never empties the router, and the health checker
reports nothing about (and keeps nothing of) a replica discovery dropped."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import cast

from kvtier.net.http_client import HttpPool
from kvtier.router.discovery import Discovery
from kvtier.router.event_feed import EventFeed
from kvtier.router.health import HealthChecker
from kvtier.router.replicas import ReplicaSet
from kvtier.router.settings import ReplicaSettings, RouterSettings
from tests.helpers.aio import run
from tests.helpers.router import fakes


@contextlib.asynccontextmanager
async def pooled() -> AsyncIterator[HttpPool]:
    """The router's HTTP client, as the health checks use it; closed on the way out."""
    pool = HttpPool(1.0, 5.0)
    try:
        yield pool
    finally:
        pool.close()


class Dns:
    """A scripted resolver: `answer` is what the name resolves to."""

    def __init__(self) -> None:
        self.answer: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        return list(self.answer)


def test_one_empty_dns_answer_keeps_the_replicas_and_two_drop_them() -> None:
    async def scenario() -> None:
        async with fakes("ok") as (fake,), pooled() as pool:
            port = int(fake.url.rpartition(":")[2])
            replicas = ReplicaSet(())
            forgotten: list[tuple[str, str]] = []
            health = HealthChecker(pool, replicas, 1.0, 1.0, 2, lambda n: None)
            dns = Dns()
            config = RouterSettings(replicas_dns=f"replicas:{port}", health_timeout_s=1.0)
            discovery = Discovery(
                config,
                replicas,
                pool,
                health.check_all,
                lambda name, cause: forgotten.append((name, cause)),
                None,
                lambda: 0.0,
                resolve=dns,
            )
            dns.answer = ["127.0.0.1"]
            await discovery.sync()
            assert [r.name for r in replicas.healthy()] == [fake.url]

            dns.answer = []  # one bad answer: kept, still in rotation
            await discovery.sync()
            assert [r.name for r in replicas.healthy()] == [fake.url]
            assert forgotten == []

            dns.answer = ["127.0.0.1"]
            await discovery.sync()
            dns.answer = []  # not confirmed by the next round: still kept
            await discovery.sync()
            assert [r.name for r in replicas.healthy()] == [fake.url]

            await discovery.sync()  # empty twice in a row: really gone (idle: dropped)
            assert len(replicas) == 0 and discovery.discovered == []
            assert forgotten == [(fake.url, "gone")]

    run(scenario(), timeout_s=30)


def test_a_probe_of_a_replica_dropped_meanwhile_reports_nothing_and_leaves_nothing() -> None:
    async def scenario() -> None:
        # hung: /health answers, completions never
        async with fakes("hang", "ok") as (hung, other), pooled() as pool:
            replicas = ReplicaSet((ReplicaSettings(url=hung.url), ReplicaSettings(url=other.url)))
            stalls: list[str] = []
            health = HealthChecker(pool, replicas, 1.0, 1.0, 2, lambda n: None, 0.5, stalls.append)
            await health.check_all()  # learns their models
            held = replicas.claim(replicas[hung.url], 0)
            replicas[hung.url].last_progress = time.monotonic() - 10.0  # no byte for long
            await health.check_all()  # sends it a probe (answered never: 0.5 s)
            probes = list(health._probes.values())
            assert len(probes) == 1
            replicas.remove(hung.url)  # discovery drops it while the probe runs
            await asyncio.wait_for(asyncio.gather(*probes, return_exceptions=True), 10.0)
            assert stalls == []  # no series recreated for a replica gone for good
            held.release()

            # a replica checked down and then dropped leaves nothing in the checker
            await other.stop()
            await health.check_all()
            await health.check_all()
            replicas.remove(other.url)
            await health.check_all()
            assert health._purged == set() and health._probes == {}

    run(scenario(), timeout_s=30)


def test_a_stopping_replica_stays_out_after_a_late_check() -> None:
    async def scenario() -> None:
        # draining: refuses as a draining vLLM
        async with fakes("refuse", "ok") as (draining, other), pooled() as pool:
            replicas = ReplicaSet(
                (ReplicaSettings(url=draining.url), ReplicaSettings(url=other.url))
            )
            health = HealthChecker(pool, replicas, 1.0, 0.5, 2, lambda n: None)
            await health.check_all()
            replica = replicas[draining.url]
            replica.stopping, replica.healthy = True, False  # as a refused request marks it
            draining.health_delay_s = 1.5  # busy with what it drains: /health answers late
            await health.check_all()
            draining.health_delay_s = 0.0
            await health.check_all()  # good, and its probe is refused (500)
            await asyncio.wait_for(
                asyncio.gather(*health._probes.values(), return_exceptions=True), 10.0
            )
            assert replica.stopping
            assert [r.name for r in replicas.healthy()] == [other.url]

    run(scenario(), timeout_s=30)


def test_a_hung_resolver_holds_one_thread_not_one_per_round() -> None:
    gate = threading.Event()
    started: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        """As `getaddrinfo` does: a thread that a timeout cannot stop."""
        started.append(host)
        await asyncio.to_thread(gate.wait, 30.0)
        return []

    async def nothing() -> None:
        pass

    async def scenario() -> None:
        config = RouterSettings(replicas_dns="replicas:8000", discovery_interval_s=0.05)
        async with pooled() as pool:
            discovery = Discovery(
                config,
                ReplicaSet(()),
                pool,
                nothing,
                lambda name, cause: None,
                None,
                lambda: 0.0,
                resolve=resolve,
            )
            try:
                for _ in range(3):
                    await discovery.sync()  # each round times out (1 s) and keeps the set
                assert len(started) == 1
            finally:
                gate.set()

    run(scenario(), timeout_s=30)


class Feed:
    """Stands for `EventFeed`: the vLLM events of a replica followed keep coming while the
    feed stops following another endpoint (`disconnect` lets the event loop run)."""

    def __init__(self, stored: dict[str, int]) -> None:
        self.stored = stored
        self.vllm: set[str] = set()

    async def connect(self, endpoint: str) -> None:
        pass

    def connect_vllm(self, replica: str, endpoint: str, replay: str | None = None) -> None:
        self.vllm.add(replica)

    async def disconnect(self, endpoint: str) -> None:
        await asyncio.sleep(0)
        for replica in self.vllm:  # a batch arrives meanwhile
            self.stored[replica] = self.stored.get(replica, 0) + 1

    async def disconnect_vllm(self, replica: str) -> None:
        self.vllm.discard(replica)


def test_a_dropped_replica_keeps_no_index_entry_from_its_last_events() -> None:
    async def scenario() -> None:
        async with fakes("ok") as (fake,), pooled() as pool:
            port = int(fake.url.rpartition(":")[2])
            replicas = ReplicaSet(())
            stored: dict[str, int] = {}  # the index: entries by replica

            def purge(name: str, cause: str) -> None:
                stored.pop(name, None)

            health = HealthChecker(pool, replicas, 1.0, 1.0, 2, lambda n: None)
            dns = Dns()
            config = RouterSettings(
                replicas_dns=f"replicas:{port}",
                replica_events_port=1,
                replica_vllm_events_port=2,
                health_timeout_s=1.0,
            )
            discovery = Discovery(
                config,
                replicas,
                pool,
                health.check_all,
                purge,
                cast(EventFeed, Feed(stored)),
                lambda: 0.0,
                resolve=dns,
            )
            dns.answer = ["127.0.0.1"]
            await discovery.sync()
            assert [r.name for r in replicas] == [fake.url]
            dns.answer = []
            await discovery.sync()
            await discovery.sync()  # gone (empty twice) and idle: dropped
            assert len(replicas) == 0
            assert stored == {}  # nothing left under a name a new pod may take again

    run(scenario(), timeout_s=30)
