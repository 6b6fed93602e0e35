"""The router's HTTP behaviour against in-process fake replicas: passthrough, failover,
streaming failures, counters, bad input, auth, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trustme

from kvtier.core.errors import ConfigError
from kvtier.core.events import EventKind
from kvtier.core.keys import block_hashes, extra_key
from kvtier.core.tiers.base import Tier
from kvtier.net.http_server import Exchange
from kvtier.net.kv_events import EventPublisher
from kvtier.router.app import Router, serving
from kvtier.router.policies import CostPolicy
from kvtier.router.settings import RouterSettings
from kvtier.router.tokenizer import Tokenizer
from kvtier.router.upstream import DELIVERED_FAILOVERS, HELD_ANSWER_BYTES
from kvtier.tools.fake_replica import adapter_path
from tests.helpers.aio import run
from tests.helpers.router import (
    MAX_MODEL_LEN,
    MODEL,
    SSE_CHUNKS,
    FakeReplica,
    completion,
    dumps,
    fakes,
    free_endpoint,
    running_router,
    sse_bytes,
)

LONG_PROMPT = " ".join(f"word{i}" for i in range(200))
ADAPTER = "sql-lora"
"""A LoRA adapter the fake replicas list (vLLM: `--lora-modules sql-lora=PATH`)."""
PATH = adapter_path(ADAPTER)
"""Its path, as the fake replicas' /v1/models cards give it (`root`)."""


async def wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def metric(text: str, sample: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")
    )


def in_flight(rr) -> dict[str, int]:
    return {r.name: r.in_flight for r in rr.router.replicas}


def queued(rr) -> dict[str, int]:
    return {r.name: r.queued_prefill_tokens for r in rr.router.replicas}


# ----- passthrough -----


def test_non_streaming_response_is_passed_through_with_the_chosen_replica(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 200
            assert resp.headers["x-kvtier-replica"] == a.url
            assert resp.json()["served_by"] == a.url
            assert a.received == [completion()]
            assert in_flight(rr) == {a.url: 0} and queued(rr) == {a.url: 0}

    run(scenario())


def test_headers_about_the_replicas_connection_are_not_relayed(tokenizer: Tokenizer) -> None:
    """Hop-by-hop headers, and those the replica's `Connection` names, stay between the
    replica and the router; the others reach the client."""

    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            a.answer_headers = (
                b"Connection: keep-alive, X-Hop\r\nX-Hop: secret\r\nUpgrade: h2c\r\n"
                b"Trailer: x-sum\r\nProxy-Authenticate: Basic\r\nX-Request-Id: 7\r\n"
            )
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.headers["x-request-id"] == "7"
            for name in ("x-hop", "upgrade", "trailer", "proxy-authenticate"):
                assert name not in resp.headers

    run(scenario())


def test_get_endpoints_answer_head_requests(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            for path in ("/health", "/v1/models"):
                resp = await rr.client.head(rr.url + path)
                assert resp.status_code == 200 and resp.content == b"", path
                assert int(resp.headers["content-length"]) > 0

    run(scenario())


def test_streaming_response_is_relayed_byte_for_byte(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        chat = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            resp = await rr.client.post(rr.url + "/v1/chat/completions", json=chat)
            assert resp.status_code == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.content == sse_bytes()

    run(scenario())


def test_models_and_health_and_metrics_endpoints_answer(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok", "ok") as reps, running_router(tokenizer, reps) as rr:
            await rr.client.post(rr.url + "/v1/completions", json=completion())
            resp = await rr.client.get(rr.url + "/v1/models")
            assert [m["id"] for m in resp.json()["data"]] == [MODEL]
            resp = await rr.client.get(rr.url + "/health")
            doc = resp.json()
            assert resp.status_code == 200 and sorted(doc["healthy_replicas"]) == sorted(
                r.url for r in reps
            )
            resp = await rr.client.get(rr.url + "/metrics")
            text = resp.text
            assert (
                'kvtier_router_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
            )
            assert 'kvtier_router_decisions_total{reason="cold",strategy="prefixaware"} 1.0' in text
            for name in (
                "kvtier_router_request_seconds_bucket",
                "kvtier_router_in_flight{",
                "kvtier_router_index_blocks{",
                "kvtier_router_overhead_seconds_count",
                "kvtier_router_replica_healthy{",
            ):
                assert name in text

    run(scenario())


# ----- routing -----


def test_prefixaware_sends_a_repeated_long_prompt_to_the_same_replica(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok", "ok") as reps, running_router(tokenizer, reps) as rr:
            chosen = []
            for suffix in ("one", "two", "three", "four"):
                resp = await rr.client.post(
                    rr.url + "/v1/completions", json=completion(LONG_PROMPT + suffix)
                )
                chosen.append(resp.headers["x-kvtier-replica"])
            assert len(set(chosen)) == 1

    run(scenario())


def test_session_strategy_sticks_to_the_header_session(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with (
            fakes("ok", "ok", "ok") as reps,
            running_router(tokenizer, reps, strategy="session") as rr,
        ):
            chosen = set()
            for i in range(5):
                resp = await rr.client.post(
                    rr.url + "/v1/completions",
                    json=completion(f"q{i}"),
                    headers={"x-session-id": "alice"},
                )
                chosen.add(resp.headers["x-kvtier-replica"])
            assert len(chosen) == 1

    run(scenario())


def test_kvaware_follows_connector_events_to_the_replica_holding_the_prefix(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        endpoint = free_endpoint()
        async with fakes("ok", "ok", "ok") as reps:
            holder = reps[2]
            with EventPublisher(endpoint, holder.url, epoch="one") as pub:
                async with running_router(
                    tokenizer, reps, strategy="kvaware", events=(endpoint,)
                ) as rr:
                    body = completion(LONG_PROMPT)
                    hashes = rr.router.tokenizer.hash_ids(
                        rr.router.tokenizer.request_tokens(body, chat=False), 16
                    )
                    for _ in range(200):  # PUB/SUB drops until the subscription propagates
                        pub.publish(EventKind.STORED, Tier.L1, hashes)
                        await asyncio.sleep(0.02)
                        if holder.url in rr.router.index.replicas():
                            break
                    assert rr.router.index.match(hashes)[holder.url] == [Tier.L1] * len(hashes)
                    for _ in range(3):
                        resp = await rr.client.post(rr.url + "/v1/completions", json=body)
                        assert resp.headers["x-kvtier-replica"] == holder.url

    run(scenario())


def test_an_adapter_request_is_hashed_with_the_adapters_name_a_base_request_is_not(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with (
            fakes("ok", "ok", adapters=(ADAPTER,)) as reps,
            running_router(tokenizer, reps) as rr,
        ):
            tokens = tokenizer.request_tokens(completion(LONG_PROMPT), chat=False)
            lora = block_hashes(tokens, 16, extra_key(lora=ADAPTER, lora_path=PATH, cache_salt="s"))
            base = block_hashes(tokens, 16, extra_key(cache_salt="s"))
            routed = cast(CostPolicy, rr.router.policy).speculative  # what the router routed by
            body = completion(LONG_PROMPT, cache_salt="s")
            resp = await rr.client.post(rr.url + "/v1/completions", json={**body, "model": ADAPTER})
            adapter_replica = resp.headers["x-kvtier-replica"]
            assert routed.match(lora)[adapter_replica] and not any(routed.match(base).values())
            resp = await rr.client.post(rr.url + "/v1/completions", json=body)
            assert routed.match(base)[resp.headers["x-kvtier-replica"]]
            assert all(r.adapters == {ADAPTER: PATH} for r in rr.router.replicas)  # model cards

    run(scenario())


def test_an_adapter_loaded_or_unloaded_at_run_time_is_served_or_refused_after_a_refresh(
    tokenizer: Tokenizer,
) -> None:
    """vLLM's `/v1/load_lora_adapter` adds a model card while the replica runs: the router
    re-reads /v1/models every `models_refresh_s` and serves (and hashes) the adapter then."""

    async def scenario() -> None:
        async with (
            fakes("ok") as (rep,),
            running_router(tokenizer, [rep], models_refresh_s=0.2) as rr,
        ):
            body = {**completion(), "model": ADAPTER}
            resp = await rr.client.post(rr.url + "/v1/completions", json=body)
            assert resp.status_code == 404
            rep.adapters = (ADAPTER,)
            replicas = rr.router.replicas
            await wait_for(lambda: replicas.adapter_path(ADAPTER) == PATH, "adapter learned")
            resp = await rr.client.post(rr.url + "/v1/completions", json=body)
            assert resp.status_code == 200
            rep.adapters = ()
            await wait_for(lambda: replicas.adapter_path(ADAPTER) is None, "adapter gone")
            resp = await rr.client.post(rr.url + "/v1/completions", json=body)
            assert resp.status_code == 404

    run(scenario())


def test_kvaware_sends_an_adapter_prompt_to_the_replica_holding_the_adapters_blocks(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        endpoints = (free_endpoint(), free_endpoint())
        async with fakes("ok", "ok", "ok", adapters=(ADAPTER,)) as reps:
            base_holder, adapter_holder = reps[0], reps[2]
            body = completion(LONG_PROMPT)
            tokens = tokenizer.request_tokens(body, chat=False)
            base = block_hashes(tokens, 16)
            lora = block_hashes(tokens, 16, extra_key(lora=ADAPTER, lora_path=PATH))
            with (
                EventPublisher(endpoints[0], base_holder.url, epoch="one") as base_pub,
                EventPublisher(endpoints[1], adapter_holder.url, epoch="one") as lora_pub,
            ):
                async with running_router(
                    tokenizer, reps, strategy="kvaware", events=endpoints
                ) as rr:
                    holders = {base_holder.url, adapter_holder.url}
                    for _ in range(200):  # PUB/SUB drops until the subscriptions propagate
                        base_pub.publish(EventKind.STORED, Tier.L1, base)
                        lora_pub.publish(EventKind.STORED, Tier.L1, lora)
                        await asyncio.sleep(0.02)
                        if holders <= rr.router.index.replicas():
                            break
                    for model, holder in ((ADAPTER, adapter_holder), (MODEL, base_holder)):
                        for _ in range(3):
                            resp = await rr.client.post(
                                rr.url + "/v1/completions", json={**body, "model": model}
                            )
                            assert resp.headers["x-kvtier-replica"] == holder.url, model

    run(scenario())


# ----- failover -----


@pytest.mark.parametrize("bad_mode", ["error500", "reset", "stopped"])
def test_a_failing_replica_is_failed_over_before_the_first_byte(
    bad_mode: str, tokenizer: Tokenizer
) -> None:
    async def scenario() -> None:
        async with (
            fakes("ok" if bad_mode == "stopped" else bad_mode, "ok") as (bad, good),
            running_router(tokenizer, [bad, good], strategy="roundrobin", read_timeout_s=0.5) as rr,
        ):
            if bad_mode == "stopped":
                await bad.stop()
            for _ in range(2):  # round robin visits the bad replica first or second
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200
                assert resp.headers["x-kvtier-replica"] == good.url
            assert in_flight(rr) == {bad.url: 0, good.url: 0}
            assert queued(rr) == {bad.url: 0, good.url: 0}
            text = rr.router.metrics.render().decode()
            failovers = metric(text, f'kvtier_router_failovers_total{{replica="{bad.url}"}}')
            routed = metric(text, f'kvtier_router_routed_total{{replica="{bad.url}"}}')
            assert failovers == routed >= 1  # every attempt on the bad replica failed over

    run(scenario())


def test_every_replica_failing_is_a_502_with_an_openai_error(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("error500", "error500") as reps, running_router(tokenizer, reps) as rr:
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 502
            error = resp.json()["error"]
            assert error["code"] == "upstream_failed" and error["type"] == "upstream_error"
            assert sorted(len(r.received) for r in reps) == [1, 1]  # each tried exactly once
            assert in_flight(rr) == {r.url: 0 for r in reps}
            # they answered, so they stay candidates: one bad request does not empty the fleet
            assert all(r.healthy for r in rr.router.replicas)

    run(scenario())


class PoisonReplica(FakeReplica):
    """Resets the connection of a request whose prompt is "poison" (as an engine that a request
    kills); answers the others."""

    def __init__(self) -> None:
        super().__init__(model=MODEL, max_model_len=MAX_MODEL_LEN, block_tokens=16)

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        if body.get("prompt") == "poison":
            self.received.append(body)
            return False
        return await super()._generate(writer, body)


class DyingReplica(PoisonReplica):
    """Dies of a request whose prompt is "poison": its connection is reset and it listens no
    more (as a vLLM server whose engine the request killed)."""

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        if body.get("prompt") == "poison" and self._server is not None:
            self._server.close()
        return await super()._generate(writer, body)


@pytest.mark.parametrize("poisoned", [PoisonReplica, DyingReplica], ids=["resets", "dies"])
def test_a_request_that_kills_its_replica_reaches_two_replicas_not_the_fleet(
    tokenizer: Tokenizer, poisoned: type[PoisonReplica]
) -> None:
    """A query of death: each replica that gets it resets (or dies: it listens no more). After
    one failure once delivered the request fails over once more (a replica killed under it),
    then gives up: 502. It arrives on a kept-alive connection (the health checks' own); a
    kept-alive connection closed before any byte is resent once on a new one, as a stale
    keep-alive socket, and a refused resend still counts the replica as one that got it."""

    async def scenario() -> None:
        replicas = [await poisoned().start() for _ in range(4)]
        try:
            async with running_router(tokenizer, replicas, health_interval_s=30.0) as rr:
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion("poison"))
                assert resp.status_code == 502
                assert resp.json()["error"]["code"] == "upstream_failed"
                reached = [r for r in replicas if r.received]
                assert len(reached) == 1 + DELIVERED_FAILOVERS
                assert all(r.healthy for r in rr.router.replicas)  # the fault is the request's
                assert in_flight(rr) == {r.url: 0 for r in replicas}
        finally:
            for r in replicas:
                await r.stop()

    run(scenario())


def test_a_reset_request_does_not_take_out_the_last_replica_for_the_others(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        replica = await PoisonReplica().start()
        try:
            async with running_router(tokenizer, [replica], health_interval_s=30.0) as rr:
                bad = await rr.client.post(rr.url + "/v1/completions", json=completion("poison"))
                assert bad.status_code == 502
                good = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert good.status_code == 200, good.text
        finally:
            await replica.stop()

    run(scenario())


def test_a_refused_connection_makes_a_replica_suspect_unless_it_is_the_last_in_rotation(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with (
            fakes("ok", "ok") as (gone, good),
            running_router(tokenizer, [gone, good], health_interval_s=30.0) as rr,
        ):
            replicas = rr.router.replicas
            await wait_for(lambda: all(r.models for r in replicas), "the first checks")
            await gone.stop()  # no check comes for 30 s: only forwards see it
            for _ in range(4):  # the policy offers the gone replica one of them at least
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.headers["x-kvtier-replica"] == good.url
            assert not replicas[gone.url].healthy  # suspect: the others avoid it
            replicas[gone.url].healthy = True
            replicas[good.url].healthy = False  # now the gone one is the last in rotation
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 502
            assert replicas[gone.url].healthy  # kept: no 503 for everyone until a check

    run(scenario())


def test_a_replica_silent_past_the_read_timeout_is_a_504_not_resent(tokenizer: Tokenizer) -> None:
    """A replica that got the request and sends nothing for `read_timeout_s` may only be slow
    (a long whole answer): resent, it would be generated twice. The client gets a 504; the
    replica stays in rotation."""

    async def scenario() -> None:
        async with (
            fakes("hang", "ok") as (slow, fast),
            running_router(
                tokenizer, [slow, fast], strategy="roundrobin", read_timeout_s=0.5
            ) as rr,
        ):
            answers = [
                await rr.client.post(rr.url + "/v1/completions", json=completion(stream=i == 1))
                for i in range(4)
            ]
            assert sorted(a.status_code for a in answers) == [200, 200, 504, 504]
            for answer in answers:
                if answer.status_code == 504:
                    error = answer.json()["error"]
                    assert error["code"] == "upstream_timeout" and slow.url in error["message"]
            assert len(slow.received) + len(fast.received) == 4  # each generated once
            assert all(r.healthy for r in rr.router.replicas)
            text = rr.router.metrics.render().decode()
            assert metric(text, f'kvtier_router_failovers_total{{replica="{slow.url}"}}') == 0
            assert in_flight(rr) == {slow.url: 0, fast.url: 0}

    run(scenario())


def test_no_healthy_replica_is_a_503(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            a.healthy = False
            await wait_for(lambda: not rr.router.replicas[a.url].healthy, "replica down")
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "no_healthy_replica"
            resp = await rr.client.get(rr.url + "/health")
            assert resp.status_code == 503

    run(scenario())


def test_no_replica_at_all_is_a_503_too(tokenizer: Tokenizer) -> None:
    """As when discovery finds no pod: the same retryable 503, not a 502 naming no failure."""

    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            rr.router.replicas.remove(a.url)
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "no_healthy_replica"
            assert a.received == []

    run(scenario())


def test_a_late_health_check_keeps_a_replica_until_unhealthy_after_a_refused_one_does_not(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("ok", "ok") as (slow, gone):
            options = {"health_interval_s": 0.3, "health_timeout_s": 0.2, "unhealthy_after": 3}
            async with running_router(tokenizer, [slow, gone], **options) as rr:
                slow.health_delay_s = 0.5  # every check times out
                replicas = rr.router.replicas
                await wait_for(lambda: replicas[slow.url].failed_checks == 1, "one late check")
                assert replicas[slow.url].healthy  # still routed to
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200
                await wait_for(lambda: not replicas[slow.url].healthy, "down after three")
                assert replicas[slow.url].failed_checks >= 3
                await gone.stop()  # nothing listens: the next check takes it out
                await wait_for(lambda: not replicas[gone.url].healthy, "refused")
                assert replicas[gone.url].failed_checks < 3

    run(scenario())


@pytest.mark.parametrize("stall_after_s", [0.5, 0.0])
def test_a_replica_whose_requests_hang_while_health_is_green_is_taken_out_and_failed_over(
    tokenizer: Tokenizer, stall_after_s: float
) -> None:
    """A gray failure: /health answers, completions never do. With stall detection the
    unanswered requests fail over and a probe keeps the replica out until it answers; off,
    they hang."""

    async def scenario() -> None:
        async with (
            fakes("hang", "ok") as (stuck, good),
            running_router(
                tokenizer, [stuck, good], strategy="roundrobin", stall_after_s=stall_after_s
            ) as rr,
        ):
            sent = [
                rr.client.post(rr.url + "/v1/completions", json=completion(stream=i % 2 == 1))
                for i in range(4)
            ]
            replica = rr.router.replicas[stuck.url]
            if not stall_after_s:
                done, hung = await asyncio.wait(map(asyncio.ensure_future, sent), timeout=3)
                assert len(hung) == 2 and replica.healthy and not replica.stalled
                for task in hung:
                    task.cancel()
                return
            answers = await asyncio.wait_for(asyncio.gather(*sent), 10)
            assert [a.status_code for a in answers] == [200] * 4
            assert {a.headers["x-kvtier-replica"] for a in answers} == {good.url}
            assert replica.stalled and not replica.healthy
            assert in_flight(rr) == {stuck.url: 0, good.url: 0}
            text = rr.router.metrics.render().decode()
            assert metric(text, f'kvtier_router_replica_stalls_total{{replica="{stuck.url}"}}') == 1
            assert metric(text, f'kvtier_router_failovers_total{{replica="{stuck.url}"}}') == 2
            await asyncio.sleep(1.0)  # more checks: /health is green, the probes still hang
            assert replica.stalled and not replica.healthy
            seen = len(stuck.received)
            stuck.mode = "ok"
            await wait_for(lambda: replica.healthy, "an answered probe brings it back")
            assert not replica.stalled
            probes = stuck.received[seen:]
            assert probes and probes[0]["max_tokens"] == 1 and probes[0]["model"] == MODEL

    run(scenario())


def test_a_stream_under_way_on_a_stalled_replica_ends_with_an_error_event(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with (
            fakes("slow_stream", "slow_stream") as pair,
            running_router(tokenizer, list(pair), stall_after_s=0.5) as rr,
        ):
            sent = asyncio.ensure_future(
                rr.client.post(rr.url + "/v1/completions", json=completion(stream=True))
            )
            await wait_for(lambda: any(f.received for f in pair), "the stream started")
            stuck, good = pair if pair[0].received else pair[::-1]
            good.mode = "ok"
            stuck.mode = "hang"  # the engine hangs from now: the probe gets no answer
            resp = await asyncio.wait_for(sent, 10)
            assert resp.status_code == 200
            body = resp.content
            assert body.startswith(SSE_CHUNKS[0])
            event = json.loads(body[len(SSE_CHUNKS[0]) :].removeprefix(b"data: "))
            assert event["error"]["code"] == 504 and "stalled" in event["error"]["message"]
            assert in_flight(rr) == {stuck.url: 0, good.url: 0}
            stuck.release.set()

    run(scenario())


@pytest.mark.parametrize("vanishes", [True, False])
def test_a_stream_on_a_replica_that_drops_off_the_network_ends_at_once_with_an_error_event(
    tokenizer: Tokenizer, vanishes: bool
) -> None:
    """A node cut off: its stream's connection is never reset, yet the client gets an error
    event once the router finds the node out of rotation and unreachable, well before the read
    timeout. A replica that only stops answering (a frozen process: its kernel still takes
    connections) keeps its stream."""

    async def scenario() -> None:
        async with (
            fakes("slow_stream", "slow_stream") as pair,
            running_router(
                tokenizer,
                list(pair),
                health_interval_s=0.1,
                health_timeout_s=0.3,
                unhealthy_after=1,
                read_timeout_s=30,
            ) as rr,
        ):
            sent = asyncio.ensure_future(
                rr.client.post(rr.url + "/v1/completions", json=completion(stream=True))
            )
            await wait_for(lambda: any(f.received for f in pair), "the stream started")
            lost, good = pair if pair[0].received else pair[::-1]
            good.mode = "ok"
            if vanishes:
                await lost.vanish()
            else:
                lost.healthy = False  # its checks fail, but it takes connections
            replica = rr.router.replicas[lost.url]
            await wait_for(lambda: not replica.healthy, "the lost replica out of rotation")
            if not vanishes:
                await asyncio.sleep(1.0)
                assert not sent.done()
                lost.release.set()
            resp = await asyncio.wait_for(sent, 5)  # far below read_timeout_s
            assert resp.status_code == 200 and resp.content.startswith(SSE_CHUNKS[0])
            text = rr.router.metrics.render().decode()
            given_up = f'kvtier_router_replica_unreachable_total{{replica="{lost.url}"}}'
            if vanishes:
                event = json.loads(resp.content[len(SSE_CHUNKS[0]) :].removeprefix(b"data: "))
                assert event["error"]["code"] == 504
                assert event["error"]["message"] == "replica unreachable: no connection"
                assert metric(text, given_up) == 1
            else:
                assert resp.content == b"".join(SSE_CHUNKS)
                assert metric(text, given_up) == 0
            assert in_flight(rr) == {lost.url: 0, good.url: 0}

    run(scenario())


def test_the_last_replica_in_rotation_is_never_stalled_out(tokenizer: Tokenizer) -> None:
    """Every replica stalls at once (the host paused): its stream waits and completes, it is
    not cut, and the replica stays in rotation."""

    async def scenario() -> None:
        async with (
            fakes("slow_stream") as (paused,),
            running_router(tokenizer, [paused], stall_after_s=0.3) as rr,
        ):
            sent = asyncio.ensure_future(
                rr.client.post(rr.url + "/v1/completions", json=completion(stream=True))
            )
            await wait_for(lambda: len(paused.received) == 1, "the stream started")
            paused.mode = "hang"
            await wait_for(lambda: len(paused.received) >= 2, "a probe was sent")
            await asyncio.sleep(1.0)  # the probe timed out at 0.3 s; more checks came
            replica = rr.router.replicas[paused.url]
            assert not replica.stalled and replica.healthy and not sent.done()
            paused.release.set()
            resp = await asyncio.wait_for(sent, 10)
            assert resp.status_code == 200 and resp.content == b"".join(SSE_CHUNKS)
            text = rr.router.metrics.render().decode()
            assert (
                metric(text, f'kvtier_router_replica_stalls_total{{replica="{paused.url}"}}') == 0
            )

    run(scenario())


def test_a_replica_going_down_is_purged_from_the_index_and_comes_back(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            await rr.client.post(rr.url + "/v1/completions", json=completion(LONG_PROMPT))
            policy = cast(CostPolicy, rr.router.policy)
            assert len(policy.speculative) > 0
            a.healthy = False
            await wait_for(lambda: len(policy.speculative) == 0, "index purge")
            a.healthy = True
            await wait_for(lambda: rr.router.replicas[a.url].healthy, "replica back")

    run(scenario())


# ----- streams that end badly -----


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("die_mid_stream") as (a,), running_router(tokenizer, [a]) as rr:
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion(stream=True))
            assert resp.status_code == 200
            body = resp.content
            assert body.startswith(SSE_CHUNKS[0])
            event = json.loads(body[len(SSE_CHUNKS[0]) :].removeprefix(b"data: "))
            assert event["error"]["type"] == "upstream_error"
            assert in_flight(rr) == {a.url: 0}
            text = rr.router.metrics.render().decode()
            assert 'kvtier_router_stream_errors_total{cause="upstream"} 1.0' in text

    run(scenario())


LARGE_ANSWER = 2 * HELD_ANSWER_BYTES + 12345
"""A whole answer past what the router holds (long logprobs, say): its halves pass the limit."""


class HalfEventReplica(FakeReplica):
    """Streams one SSE event and half of the next, then resets the connection."""

    def __init__(self) -> None:
        super().__init__(model=MODEL, max_model_len=MAX_MODEL_LEN, block_tokens=16)

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        self.received.append(body)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        event = SSE_CHUNKS[1]
        for chunk in (SSE_CHUNKS[0], event[: len(event) // 2]):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            await asyncio.sleep(0.05)
        return False


def test_a_stream_cut_mid_event_ends_with_an_error_event_apart_from_the_half_event(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        replica = await HalfEventReplica().start()
        try:
            async with running_router(tokenizer, [replica]) as rr:
                resp = await rr.client.post(
                    rr.url + "/v1/completions", json=completion(stream=True)
                )
                events = [e for e in resp.content.split(b"\n\n") if e.strip()]
                assert events[0] + b"\n\n" == SSE_CHUNKS[0]
                assert events[1] == SSE_CHUNKS[1][: len(SSE_CHUNKS[1]) // 2]  # as it came
                error = json.loads(events[-1].removeprefix(b"data: "))["error"]
                assert error["type"] == "upstream_error" and error["code"] == 502
        finally:
            await replica.stop()

    run(scenario())


def test_a_whole_answer_larger_than_the_router_holds_is_relayed_as_it_comes(
    tokenizer: Tokenizer,
) -> None:
    """The router's memory per request stays bounded: the client has the answer's head and
    first half while the replica still holds the second; the answer arrives whole."""

    async def scenario() -> None:
        async with fakes("slow_answer") as (a,), running_router(tokenizer, [a]) as rr:
            a.answer_bytes = LARGE_ANSWER
            request = rr.client.build_request("POST", rr.url + "/v1/completions", json=completion())
            resp = await asyncio.wait_for(rr.client.send(request, stream=True), 10)
            assert resp.status_code == 200 and resp.headers["x-kvtier-replica"] == a.url
            raw = resp.aiter_raw()
            received = b""
            while len(received) <= HELD_ANSWER_BYTES:
                received += await asyncio.wait_for(anext(raw), 10)
            assert not a.release.is_set()  # relayed while the replica holds the rest
            a.release.set()
            async for chunk in raw:
                received += chunk
            doc = json.loads(received)
            assert len(doc["choices"][0]["text"]) == LARGE_ANSWER
            assert doc["served_by"] == a.url
            await wait_for(lambda: in_flight(rr) == {a.url: 0}, "in-flight release")
            text = rr.router.metrics.render().decode()
            assert metric(text, f'kvtier_router_prompt_tokens_total{{replica="{a.url}"}}') == 1

    run(scenario())


def test_a_replica_failing_mid_answer_fails_over_or_cuts_a_large_answer(
    tokenizer: Tokenizer,
) -> None:
    """A whole answer the router still holds is resent to another replica; one already being
    relayed cannot be, and the client's connection is dropped (its body stays incomplete)."""

    async def scenario() -> None:
        async with (
            fakes("die_mid_answer", "ok") as (dying, good),
            running_router(tokenizer, [dying, good], strategy="roundrobin") as rr,
        ):
            for _ in range(2):  # round robin visits the dying replica first or second
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.json()["served_by"] == good.url
            assert len(dying.received) >= 1
        async with fakes("die_mid_answer") as (a,), running_router(tokenizer, [a]) as rr:
            a.answer_bytes = LARGE_ANSWER
            with pytest.raises(httpx.RemoteProtocolError):
                await rr.client.post(rr.url + "/v1/completions", json=completion())
            await wait_for(lambda: in_flight(rr) == {a.url: 0}, "in-flight release")
            text = rr.router.metrics.render().decode()
            assert 'kvtier_router_stream_errors_total{cause="upstream"} 1.0' in text
            assert len(a.received) == 1  # committed: never resent

    run(scenario())


def test_an_answer_the_replica_aborted_is_retried_elsewhere_or_ends_the_stream_with_an_error(
    tokenizer: Tokenizer,
) -> None:
    """vLLM stopping (SIGTERM) answers its requests in flight cut short, status 200."""

    async def scenario() -> None:
        async with (
            fakes("abort", "ok") as (stopping, good),
            running_router(tokenizer, [stopping, good], strategy="roundrobin") as rr,
        ):
            for _ in range(2):  # round robin visits the stopping replica first or second
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.headers["x-kvtier-replica"] == good.url
                assert resp.json()["choices"][0]["finish_reason"] == "length"
            text = rr.router.metrics.render().decode()
            failovers = metric(text, f'kvtier_router_failovers_total{{replica="{stopping.url}"}}')
            assert failovers == len(stopping.received) >= 1  # every aborted answer failed over
        async with fakes("abort") as (a,), running_router(tokenizer, [a]) as rr:
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion(stream=True))
            body = resp.content
            assert body.startswith(SSE_CHUNKS[0]) and b"[DONE]" not in body
            event = json.loads(body[len(SSE_CHUNKS[0]) :].removeprefix(b"data: "))
            assert event["error"]["type"] == "upstream_error"
            text = rr.router.metrics.render().decode()
            assert 'kvtier_router_stream_errors_total{cause="upstream"} 1.0' in text

    run(scenario())


REFUSAL_SHAPES: list[tuple[str | list[int], bool, bool]] = [
    # (prompt, stream, include_usage): how a draining vLLM refuses each
    ("hello world", False, False),  # 500 "cannot schedule new futures after shutdown"
    ("hello world", True, False),  # the same 500
    ([1, 2, 3], False, False),  # 200, cut short at once: `finish_reason` "abort"
    ([1, 2, 3], True, False),  # a stream of `[DONE]` alone: an empty answer if relayed
    ([1, 2, 3], True, True),  # a usage event with no choice, then `[DONE]`
]


def test_a_draining_replica_leaves_rotation_at_its_first_refusal_until_it_answers_again(
    tokenizer: Tokenizer,
) -> None:
    """vLLM draining keeps /health at 200 and refuses every new request. Each shape of refusal
        is resent to the other replica; the first takes the refusing replica out of rotation, so
        the requests after it, through good health checks, go straight to the other one. Once it
        answers the health checker's probe completion, or fails a check (it exits) and passes one
    (it restarted), it serves again."""

    async def scenario() -> None:
        async with (
            fakes("ok", "ok") as (draining, good),
            running_router(tokenizer, [draining, good], strategy="roundrobin") as rr,
        ):
            state = rr.router.replicas[draining.url]

            def requests_on_draining() -> int:
                return sum(b.get("prompt") != "ping" for b in draining.received)  # not probes

            async def send_both_ways(prompt: str | list[int], stream: bool, usage: bool) -> None:
                for _ in range(2):  # round robin offers the draining replica one of them
                    body = completion(prompt, stream=stream)
                    if usage:
                        body["stream_options"] = {"include_usage": True}
                    resp = await rr.client.post(rr.url + "/v1/completions", json=body)
                    assert resp.status_code == 200 and resp.headers["x-kvtier-replica"] == good.url
                    if stream:
                        assert resp.content == b"".join(SSE_CHUNKS)
                    else:
                        assert resp.json()["choices"][0]["finish_reason"] == "length"

            for i, (prompt, stream, usage) in enumerate(REFUSAL_SHAPES):
                draining.mode = "refuse"
                before = requests_on_draining()
                await send_both_ways(prompt, stream, usage)
                assert requests_on_draining() == before + 1 and state.state == "stopping"
                probes = len(draining.received) - requests_on_draining()
                await asyncio.sleep(1.0)  # five health checks, each answered 200
                await send_both_ways(prompt, stream, usage)
                assert requests_on_draining() == before + 1  # still out of rotation
                assert len(draining.received) - requests_on_draining() > probes  # probed
                if i % 2:  # it exits and restarts on the same address: /health fails a while
                    draining.healthy = False
                    await wait_for(lambda: not state.stopping, "a failed check ends stopping")
                    draining.healthy = True
                draining.mode = "ok"  # it serves again: the probe, or the restart, brings it back
                await wait_for(lambda: state.healthy and not state.stopping, "back in rotation")
            text = rr.router.metrics.render().decode()
            for name in ("kvtier_router_failovers_total", "kvtier_router_replica_stopping_total"):
                assert metric(text, f'{name}{{replica="{draining.url}"}}') == len(REFUSAL_SHAPES)
            shapes = {
                (isinstance(b["prompt"], list), bool(b.get("stream")), "stream_options" in b)
                for b in draining.received
                if b["prompt"] != "ping"
            }
            assert len(shapes) == len(REFUSAL_SHAPES)

    run(scenario())


def test_a_client_leaving_mid_stream_releases_the_in_flight_counter(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("slow_stream") as (a,), running_router(tokenizer, [a]) as rr:
            request = rr.client.build_request(
                "POST", rr.url + "/v1/completions", json=completion(LONG_PROMPT, stream=True)
            )
            resp = await rr.client.send(request, stream=True)
            assert await anext(resp.aiter_raw()) == SSE_CHUNKS[0]
            assert in_flight(rr) == {a.url: 1}
            assert queued(rr) == {a.url: 0}  # the first byte came back
            await resp.aclose()  # the client hangs up mid-stream
            await wait_for(lambda: in_flight(rr) == {a.url: 0}, "in-flight release")
            a.release.set()

    run(scenario())


class WatchingReplica(FakeReplica):
    """Completions wait, unanswered, until the router drops their connection (`dropped` is
    set then)."""

    def __init__(self) -> None:
        super().__init__(model=MODEL, max_model_len=MAX_MODEL_LEN, block_tokens=16)
        self.dropped = asyncio.Event()
        self._readers: dict[asyncio.StreamWriter, asyncio.StreamReader] = {}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._readers[writer] = reader
        await super()._serve(reader, writer)

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        self.received.append(body)
        with contextlib.suppress(ConnectionError):
            await self._readers[writer].read()  # until the router's end of the connection
        self.dropped.set()
        return False


@pytest.mark.parametrize("body_mib", [0, 2])
def test_a_client_leaving_before_its_answer_aborts_the_request_on_the_replica(
    tokenizer: Tokenizer, body_mib: int
) -> None:
    """Also after a body large enough that the router paused reading the connection until it
    read it (a base64 image, a long prompt): reading resumes once the body is in, so the
    hang-up is seen."""

    async def scenario() -> None:
        replica = await WatchingReplica().start()
        try:
            async with running_router(tokenizer, [replica]) as rr:
                host, port = rr.url.removeprefix("http://").split(":")
                body = dumps(completion())[:-1] + b" " * (body_mib << 20) + b"}"
                _, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                await wait_for(lambda: replica.received, "the replica got the request")
                writer.close()  # the client hangs up
                await asyncio.wait_for(replica.dropped.wait(), 5)  # vLLM aborts the request
                await wait_for(lambda: in_flight(rr) == {replica.url: 0}, "in-flight release")
        finally:
            await replica.stop()

    run(scenario())


def test_a_stream_given_up_on_as_its_client_leaves_is_not_resent(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The health checker abandons a stream under way in the same loop turn as its client
    hangs up: the stream ends there; it is never started again on another replica."""
    exchanges: list[Exchange] = []
    generate = Router._generate

    async def noting(router: Router, exchange: Exchange, endpoint: str, chat: bool) -> int:
        exchanges.append(exchange)
        return await generate(router, exchange, endpoint, chat)

    monkeypatch.setattr(Router, "_generate", noting)

    async def scenario() -> None:
        async with (
            fakes("slow_stream", "slow_stream") as pair,
            running_router(tokenizer, list(pair), strategy="roundrobin") as rr,
        ):
            request = rr.client.build_request(
                "POST", rr.url + "/v1/completions", json=completion(stream=True)
            )
            resp = await rr.client.send(request, stream=True)
            assert await anext(resp.aiter_raw()) == SSE_CHUNKS[0]
            stuck, other = pair if pair[0].received else pair[::-1]
            other.mode = "ok"
            exchanges[0].abort()  # the client's connection drops...
            rr.router.replicas[stuck.url].abandon_requests("stalled: no progress")  # ...and this
            await wait_for(lambda: in_flight(rr) == {stuck.url: 0, other.url: 0}, "release")
            await asyncio.sleep(0.3)
            assert other.received == []
            text = rr.router.metrics.render().decode()
            assert 'kvtier_router_stream_errors_total{cause="client"} 1.0' in text
            assert metric(text, f'kvtier_router_failovers_total{{replica="{stuck.url}"}}') == 0
            await resp.aclose()
            stuck.release.set()

    run(scenario())


class FloodingReplica(FakeReplica):
    """Streams 64 KiB events until its connection is cut (`cut` is set then)."""

    def __init__(self) -> None:
        super().__init__(model=MODEL, max_model_len=MAX_MODEL_LEN)
        self.cut = asyncio.Event()

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        event = b'data: {"choices": [{"text": "%s"}]}\n\n' % (b"x" * 65536)
        try:
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
        except ConnectionError:
            self.cut.set()
            return False


def test_a_client_that_stops_reading_a_stream_is_cut_off_and_releases_the_replica(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        replica = await FloodingReplica().start()
        try:
            async with running_router(tokenizer, [replica], client_timeout_s=0.5) as rr:
                host, port = rr.url.removeprefix("http://").split(":")
                _, writer = await asyncio.open_connection(host, int(port))
                request = dumps(completion(stream=True))
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(request), request)
                )  # and never read the answer
                await asyncio.wait_for(replica.cut.wait(), 15)  # the upstream stream aborted
                await wait_for(lambda: in_flight(rr) == {replica.url: 0}, "in-flight release")
                writer.close()
                text = rr.router.metrics.render().decode()
                assert 'kvtier_router_stream_errors_total{cause="client"} 1.0' in text
        finally:
            await replica.stop()

    run(scenario())


def test_a_client_leaving_after_done_got_its_whole_answer(tokenizer: Tokenizer) -> None:
    """A client may close at `[DONE]`, before the body's end: that answer is served (200),
    not a hang-up (499)."""

    async def scenario() -> None:
        async with fakes("slow_end") as (a,), running_router(tokenizer, [a]) as rr:
            request = rr.client.build_request(
                "POST", rr.url + "/v1/completions", json=completion(LONG_PROMPT, stream=True)
            )
            resp = await rr.client.send(request, stream=True)
            received = b""
            async for raw in resp.aiter_raw():
                received += raw
                if received.endswith(SSE_CHUNKS[-1]):
                    break
            await resp.aclose()
            await asyncio.sleep(0.2)  # the router sees the hang-up while the replica holds
            a.release.set()
            await wait_for(lambda: in_flight(rr) == {a.url: 0}, "in-flight release")
            text = rr.router.metrics.render().decode()
            assert (
                'kvtier_router_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
            )
            assert 'status="499"' not in text

    run(scenario())


def test_queued_prefill_counts_uncached_prompt_tokens_until_the_first_byte(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("hang") as (a,), running_router(tokenizer, [a], read_timeout_s=30) as rr:
            task = asyncio.create_task(
                rr.client.post(rr.url + "/v1/completions", json=completion(LONG_PROMPT))
            )
            exact = len(rr.router.tokenizer.request_tokens(completion(LONG_PROMPT), chat=False))
            tokens = rr.router.tokenizer.prompt(
                completion(LONG_PROMPT), chat=False
            ).estimated_tokens  # the router weighs the unencoded tail by its bytes
            assert abs(tokens - exact) <= exact // 10
            await wait_for(lambda: in_flight(rr) == {a.url: 1}, "request in flight")
            assert queued(rr) == {a.url: tokens}
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_for(lambda: in_flight(rr) == {a.url: 0}, "in-flight release")
            assert queued(rr) == {a.url: 0}

    run(scenario())


# ----- bad input -----

BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", dumps({"prompt": "x"}), 400, "model"),
    ("/v1/completions", dumps({"model": MODEL}), 400, "prompt"),
    ("/v1/completions", dumps({"model": MODEL, "prompt": 5}), 400, "prompt"),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "x", "stream": "yes"}), 400, "stream"),
    (
        "/v1/completions",
        dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}),
        400,
        "max_tokens",
    ),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
    ("/v1/completions", dumps({"model": 7, "prompt": "x"}), 400, "model"),
    ("/v1/completions", dumps({"model": "gpt-9", "prompt": "x"}), 404, "model"),
    ("/v1/completions", dumps({"model": MODEL, "prompt": "hi " * MAX_MODEL_LEN}), 400, "prompt"),
    (
        "/v1/completions",
        dumps({"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
        400,
        "prompt",
    ),
    (
        "/v1/completions",
        dumps({"model": MODEL, "prompt": "x", "truncate_prompt_tokens": -2}),
        400,
        "truncate_prompt_tokens",
    ),
    (
        "/v1/completions",
        dumps(
            {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 1, "truncation_side": "up"}
        ),
        400,
        "truncation_side",
    ),
    ("/v1/chat/completions", dumps({"model": MODEL, "messages": "hi"}), 400, "messages"),
    ("/v1/chat/completions", dumps({"model": MODEL, "messages": []}), 400, "messages"),
    (
        "/v1/chat/completions",
        dumps({"model": MODEL, "messages": [{"content": "x"}]}),
        400,
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        dumps({"model": MODEL, "messages": [{"role": "user", "content": 3}]}),
        400,
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        dumps({"model": MODEL, "tools": "x", "messages": [{"role": "user", "content": "x"}]}),
        400,
        "tools",
    ),
]


def test_a_prompt_too_long_but_truncated_by_the_request_is_served(tokenizer: Tokenizer) -> None:
    """vLLM keeps the last `truncate_prompt_tokens` tokens: the router checks that length."""

    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            body = completion(prompt="hi " * MAX_MODEL_LEN, truncate_prompt_tokens=100)
            resp = await rr.client.post(rr.url + "/v1/completions", json=body)
            assert resp.status_code == 200
            assert a.received[-1]["truncate_prompt_tokens"] == 100

    run(scenario())


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_gets_a_4xx_openai_error_and_reaches_no_replica(
    path: str, body: bytes, status: int, param: str | None, tokenizer: Tokenizer
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            resp = await rr.client.post(
                rr.url + path, content=body, headers={"Content-Type": "application/json"}
            )
            assert resp.status_code == status
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == param
            assert a.received == []
            # the router still serves
            resp = await rr.client.post(rr.url + path.replace("chat/", ""), json=completion())
            assert resp.status_code == 200

    run(scenario())


def test_oversize_body_unknown_route_and_wrong_method_get_openai_errors(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], max_body_bytes=1024) as rr:
            for method, path, body, status in [
                ("POST", "/v1/completions", b"x" * 4096, 413),
                ("POST", "/v1/nothing", b"{}", 404),
                ("GET", "/v1/completions", b"", 405),
            ]:
                resp = await rr.client.request(method, rr.url + path, content=body)
                assert resp.status_code == status
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

    run(scenario())


def test_a_405_lists_the_methods_the_path_takes_in_allow(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            for method, path, allow in [
                ("GET", "/v1/completions", "POST"),
                ("HEAD", "/v1/chat/completions", "POST"),
                ("POST", "/health", "GET, HEAD"),
                ("DELETE", "/v1/models", "GET, HEAD"),
                ("PUT", "/dashboard/data", "GET, HEAD"),
            ]:
                resp = await rr.client.request(method, rr.url + path)
                assert (resp.status_code, resp.headers.get("allow")) == (405, allow), method
            # only a 405 carries it
            for method, path in [("GET", "/health"), ("POST", "/v1/nothing")]:
                resp = await rr.client.request(method, rr.url + path)
                assert resp.status_code != 405 and "allow" not in resp.headers

    run(scenario())


def test_a_chunked_upload_is_capped_and_expect_100_continue_is_served(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], max_body_bytes=1024) as rr:

            async def chunks(n: int):
                for _ in range(n):
                    yield b" " * 512

            resp = await rr.client.post(
                rr.url + "/v1/completions",
                content=chunks(4),
                headers={"Content-Type": "application/json"},
            )
            assert resp.status_code == 413  # no Content-Length to refuse up front
            assert resp.json()["error"]["type"] == "invalid_request_error"
            resp = await rr.client.post(
                rr.url + "/v1/completions", json=completion(), headers={"Expect": "100-continue"}
            )
            assert resp.status_code == 200
            assert len(a.received) == 1

    run(scenario())


def test_a_port_already_taken_or_an_unknown_host_is_a_config_error_naming_it(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        router = Router(RouterSettings(replicas=["http://127.0.0.1:1"]), tokenizer=tokenizer)
        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = taken.getsockname()[1]
            with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: Address"):
                async with serving(router, "127.0.0.1", port):
                    pass
        with pytest.raises(ConfigError, match="cannot listen on host.invalid:0: ") as info:
            async with serving(router, "host.invalid", 0):
                pass
        assert "Unknown error" not in str(info.value)

    run(scenario())


def test_api_key_is_required_on_v1_but_not_on_health(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], api_key="s3cret") as rr:
            resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
            resp = await rr.client.post(
                rr.url + "/v1/completions",
                json=completion(),
                headers={"Authorization": "Bearer wrong"},
            )
            assert resp.status_code == 401
            resp = await rr.client.post(
                rr.url + "/v1/completions",
                json=completion(),
                headers={"Authorization": "Bearer s3cret"},
            )
            assert resp.status_code == 200
            resp = await rr.client.get(rr.url + "/health")
            assert resp.status_code == 200

    run(scenario())


def test_a_shared_key_sending_a_tenant_salt_is_a_400_naming_cache_salt(
    tokenizer: Tokenizer,
) -> None:
    async def scenario() -> None:
        async with fakes("ok") as (a,), running_router(tokenizer, [a], api_key="s3cret") as rr:
            forged = rr.router.auth.cache_salt("alpha", None)  # computable by anyone
            resp = await rr.client.post(
                rr.url + "/v1/completions",
                json=completion(cache_salt=forged),
                headers={"Authorization": "Bearer s3cret"},
            )
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt"
            assert a.received == []

    run(scenario())


def test_many_concurrent_requests_leave_every_counter_at_zero(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with fakes("ok", "error500", "ok") as reps, running_router(tokenizer, reps) as rr:

            async def one(i: int) -> int:
                resp = await rr.client.post(
                    rr.url + "/v1/completions",
                    json=completion(f"p{i % 3} " + LONG_PROMPT, stream=i % 2 == 0),
                )
                return resp.status_code

            statuses = await asyncio.gather(*(one(i) for i in range(30)))
            assert statuses == [200] * 30
            assert set(in_flight(rr).values()) == {0} and set(queued(rr).values()) == {0}

    run(scenario())


def test_an_https_replica_is_served_with_its_ca_and_refused_without(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    async def scenario() -> None:
        replica = await FakeReplica(tls=server_tls, model=MODEL, block_tokens=16).start()
        try:
            async with running_router(tokenizer, [replica], replica_ca_file=str(ca_file)) as rr:
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.json()["served_by"] == replica.url
            async with running_router(tokenizer, [replica]) as rr:  # the system's CAs only
                resp = await rr.client.post(rr.url + "/v1/completions", json=completion())
                assert resp.status_code == 503  # its health checks fail: not a 500
                assert resp.json()["error"]["code"] == "no_healthy_replica"
        finally:
            await replica.stop()

    run(scenario())


def test_a_missing_ca_file_is_a_config_error(tmp_path: Path, tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        router = Router(
            RouterSettings(
                replicas=["https://127.0.0.1:1"], replica_ca_file=str(tmp_path / "none.pem")
            ),
            tokenizer=tokenizer,
        )
        with pytest.raises(ConfigError, match="^replica_ca_file: cannot load"):
            async with serving(router, "127.0.0.1", 0):
                pass

    run(scenario())
