"""The health checker and discovery outlive a replica's absurd answers and their own failures:
one replica can never stop the others from being checked, nor discovery from running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from kvtier.net.http_client import HttpPool
from kvtier.router.discovery import Discovery
from kvtier.router.health import HealthChecker, engine_block_tokens
from kvtier.router.replicas import ReplicaSet
from kvtier.router.settings import ReplicaSettings, RouterSettings
from tests.helpers.aio import run

Answer = Callable[[str], tuple[int, bytes]]


@asynccontextmanager
async def replica(
    answer: Answer, delay: Callable[[str], float] = lambda path: 0.0
) -> AsyncIterator[str]:
    """A loopback HTTP server answering each GET path with `answer(path)`, `delay(path)`
    seconds late; yields its URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                path = line.split()[1].decode()
                if seconds := delay(path):
                    await asyncio.sleep(seconds)
                status, body = answer(path)
                writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body)))
                writer.write(body)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


def models(path: str) -> tuple[int, bytes]:
    return 200, b'{"data":[{"id":"m","max_model_len":100}]}' if path == "/v1/models" else b""


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/models", b"[" * 100_000),  # past the JSON parser's recursion limit
        ("/metrics", b'vllm:cache_config_info{block_size="' + b"1" * 5000 + b'"} 1\n'),
    ],
    ids=["nested-models", "huge-block-size"],
)
def test_an_absurd_answer_from_one_replica_never_stops_the_checks_of_the_others(
    path: str, body: bytes
) -> None:
    good_up = True

    def good(asked: str) -> tuple[int, bytes]:
        return (200 if good_up else 500, b"") if asked == "/health" else models(asked)

    def absurd(asked: str) -> tuple[int, bytes]:
        return (200, body) if asked == path else models(asked)

    async def scenario() -> None:
        nonlocal good_up
        async with replica(good) as url_good, replica(absurd) as url_absurd:
            replicas = ReplicaSet((ReplicaSettings(url=url_good), ReplicaSettings(url=url_absurd)))
            pool = HttpPool(1.0, 2.0)
            downs: list[str] = []
            health = HealthChecker(pool, replicas, 0.05, 1.0, 2, downs.append)
            await health.check_all()  # (raised before)
            assert replicas[url_absurd].healthy and replicas[url_good].models == ("m",)
            checking = asyncio.create_task(health.run())
            good_up = False
            try:
                async with asyncio.timeout(5):
                    while not downs:
                        await asyncio.sleep(0.02)
                assert downs == [url_good] and not checking.done()
            finally:
                checking.cancel()
                await asyncio.gather(checking, return_exceptions=True)
                pool.close()

    run(scenario())


def test_a_block_size_of_absurd_length_is_not_learned() -> None:
    assert engine_block_tokens(b'vllm:cache_config_info{block_size="128"} 1\n') == 128
    assert (
        engine_block_tokens(b'vllm:cache_config_info{block_size="' + b"9" * 5000 + b'"} 1') is None
    )


def test_discovery_goes_on_after_a_round_that_failed_unexpectedly() -> None:
    calls = 0

    async def resolve(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a resolver bug")
        return []

    async def nothing() -> None:
        pass

    async def scenario() -> None:
        config = RouterSettings(replicas_dns="pods.invalid:8000", discovery_interval_s=0.02)
        pool = HttpPool(1.0, 1.0)
        discovery = Discovery(
            config, ReplicaSet(()), pool, nothing, lambda *_: None, None, lambda: 0.0, resolve
        )
        rounds = asyncio.create_task(discovery.run())
        try:
            async with asyncio.timeout(5):
                while calls < 3:
                    await asyncio.sleep(0.01)
            assert not rounds.done()
        finally:
            rounds.cancel()
            await asyncio.gather(rounds, return_exceptions=True)
            pool.close()

    run(scenario())


def test_checks_that_only_time_out_keep_the_index_and_a_refused_one_purges_it_once() -> None:
    """A slow or stopped replica keeps its cache: it is out of rotation, not purged (nothing
    would re-send its state when it answers again); a refused connection means it is gone."""
    slow = False

    def delay(path: str) -> float:
        return 5.0 if slow and path == "/health" else 0.0

    async def scenario() -> None:
        nonlocal slow
        pool = HttpPool(1.0, 2.0)
        downs: list[str] = []
        try:
            async with replica(models, delay) as url:
                replicas = ReplicaSet((ReplicaSettings(url=url),))
                health = HealthChecker(pool, replicas, 0.05, 0.2, 2, downs.append)
                await health.check_all()
                assert replicas[url].healthy
                slow = True
                for _ in range(3):
                    await health.check_all()
                assert not replicas[url].healthy and downs == []
            for _ in range(2):  # the server is closed: refused
                await health.check_all()
            assert downs == [url]
        finally:
            pool.close()

    run(scenario())
