"""The router in front of two real vLLM replicas serving the embedded model.

One module-scoped fixture starts both engines (1 thread each, pinned to cores 0 and 1) with
vLLM's own KV events on IPC sockets and a 60 s drain on stop; tests start routers in threads in
front of them. The failover tests stop replicas, so they run last.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvtier.core.keys import block_hashes
from kvtier.net.ports import free_port
from kvtier.router.settings import ReplicaSettings, RouterSettings
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.embedded_model import resolve_model
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerProcess, ServerSpec
from tests.helpers.engines import metric, metric_in
from tests.helpers.router import RouterThread

pytestmark = pytest.mark.engine

BLOCK = 128
MAX_LEN = 4096


@dataclass
class Engine:
    spec: ServerSpec
    events: str
    process: ServerProcess

    @property
    def url(self) -> str:
        return self.process.url

    def restart(self) -> None:
        self.process.stop()
        self.process = ServerProcess(self.spec)
        self.process.wait_healthy(600)

    def prefix_hits(self) -> float:
        return metric(self.process, "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    model = resolve_model(None)
    tmp = tmp_path_factory.mktemp("vllm")
    engines: list[Engine] = []
    try:
        for i in range(2):
            events = f"ipc://{tmp}/kv-events-{i}"
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": events,
                "topic": "kv",
            }
            spec = ServerSpec(
                model=model,
                port=free_port(),
                threads=1,
                cpu_ids=str(i),
                queue_wait=SHARED_MACHINE_WAIT,
                max_model_len=MAX_LEN,
                drain_s=60,
                extra_args=["--kv-events-config", json.dumps(config)],
                log_path=Path(tmp, f"vllm-{i}.log"),
            )
            engines.append(Engine(spec, events, ServerProcess(spec)))
        for engine in engines:
            engine.process.wait_healthy(600)
        yield engines
    finally:
        for engine in engines:
            engine.process.stop()


def router_config(engines: list[Engine], strategy: str, events: bool = False) -> RouterSettings:
    """No block size given: the router reads the engines' own from their /metrics."""
    return RouterSettings(
        replicas=[
            ReplicaSettings(url=e.url, vllm_events=e.events if events else None) for e in engines
        ],
        strategy=strategy,
        port=0,
        health_interval_s=0.5,
        seed=1,
    )


def model_name() -> str:
    return Path(resolve_model(None)).name


def token_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def post(url: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={"model": model_name(), **body}, timeout=timeout
    )


def test_shared_prefix_requests_land_where_the_prefix_is_cached(
    engines: list[Engine], tokenizer: Tokenizer
) -> None:
    prefixes = {p: token_prompt(p, 4 * BLOCK) for p in range(3)}
    before = [e.prefix_hits() for e in engines]
    chosen: dict[int, set[str]] = {p: set() for p in prefixes}
    with RouterThread(router_config(engines, "prefixaware"), tokenizer) as rt:
        assert rt.call(lambda: rt.router.block_tokens) == BLOCK  # read from the engines
        for suffix in range(3):
            for p, prefix in prefixes.items():
                resp = post(
                    rt.url, {"prompt": prefix + token_prompt(100 + suffix, 20), "max_tokens": 2}
                )
                assert resp.status_code == 200, resp.text
                chosen[p].add(resp.headers["x-kvtier-replica"])
    assert all(len(replicas) == 1 for replicas in chosen.values()), chosen
    hits = sum(e.prefix_hits() - b for e, b in zip(engines, before, strict=True))
    assert hits >= len(prefixes) * 2 * 4 * BLOCK  # every repeat hit its 4 cached blocks


def _normalize(sse: bytes) -> bytes:
    sse = re.sub(rb'"id":"[^"]*"', b'"id":"X"', sse)
    return re.sub(rb'"created":\d+', b'"created":0', sse)


def test_streaming_through_the_router_matches_a_direct_stream_byte_for_byte(
    engines: list[Engine], tokenizer: Tokenizer
) -> None:
    body = {
        "model": model_name(),
        "prompt": "The capital of France is",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    }
    with (
        RouterThread(router_config(engines, "roundrobin"), tokenizer) as rt,
        httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=120) as resp,
    ):
        via_router = resp.read()
        replica = resp.headers["x-kvtier-replica"]
    with httpx.stream("POST", replica + "/v1/completions", json=body, timeout=120) as resp:
        direct = resp.read()
    assert via_router.endswith(b"data: [DONE]\n\n")
    assert _normalize(via_router) == _normalize(direct)


def test_chat_with_tools_and_bad_input_through_the_router(
    engines: list[Engine], tokenizer: Tokenizer
) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "weather", "description": "w", "parameters": {"type": "object"}},
        }
    ]
    with RouterThread(router_config(engines, "prefixaware"), tokenizer) as rt:
        chat = {
            "model": model_name(),
            "max_tokens": 4,
            "tools": tools,
            "tool_choice": "none",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        }
        ok = httpx.post(rt.url + "/v1/chat/completions", timeout=120, json=chat)
        assert ok.status_code == 200, ok.text
        # the router tokenized exactly as the engine did (template, tools, content parts)
        assert ok.json()["usage"]["prompt_tokens"] == len(tokenizer.request_tokens(chat, chat=True))
        for body, status, param in [
            ({"prompt": "x" * 10}, 400, "model"),
            ({"model": "nope", "prompt": "x"}, 404, "model"),
            ({"model": model_name(), "prompt": token_prompt(1, MAX_LEN)}, 400, "prompt"),
            ({"model": model_name(), "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ]:
            resp = httpx.post(rt.url + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == status, resp.text
            assert resp.json()["error"]["param"] == param
        bad = httpx.post(rt.url + "/v1/completions", content=b"{oops", timeout=60)
        assert bad.status_code == 400 and set(bad.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


def place_prefix(
    rt: RouterThread, engines: list[Engine], seed: int, blocks: int
) -> tuple[list[int], Engine, Engine]:
    """Serve a prefix of `blocks` blocks once and wait until the router's index, fed by vLLM's
    own KV events, holds all of them on the replica that served it; returns (prefix, that
    replica, the other one)."""
    prefix = token_prompt(seed, blocks * BLOCK)
    resp = post(rt.url, {"prompt": prefix + [11, 12], "max_tokens": 2})
    holder = next(e for e in engines if e.url == resp.headers["x-kvtier-replica"])
    other = next(e for e in engines if e is not holder)
    hashes = block_hashes(prefix, BLOCK)
    for _ in range(100):
        if len(rt.call(lambda: rt.router.index.match(hashes).get(holder.url, []))) == blocks:
            break
        time.sleep(0.1)
    assert len(rt.call(lambda: rt.router.index.match(hashes)[holder.url])) == blocks
    return prefix, holder, other


@contextlib.contextmanager
def stream_under_way(
    rt: RouterThread, prompt: list[int], max_tokens: int, on: Engine
) -> Iterator[tuple[bytes, Iterator[bytes]]]:
    """A stream of exactly `max_tokens` tokens (usage in its last event) through the router,
    checked to be served by `on`; yields its first chunk and the rest to come."""
    body = {
        "model": model_name(),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", rt.url + "/v1/completions", json=body, timeout=120) as stream:
        assert stream.headers["x-kvtier-replica"] == on.url
        chunks = stream.iter_raw()
        first = next(chunks)
        assert first.startswith(b"data: ")
        yield first, chunks


def test_kill_fails_over_ends_streams_with_an_error_and_purges_on_restart(
    engines: list[Engine], tokenizer: Tokenizer
) -> None:
    with RouterThread(router_config(engines, "kvaware", events=True), tokenizer) as rt:
        prefix, victim, survivor = place_prefix(rt, engines, seed=7, blocks=3)

        # a long stream on the victim, killed mid-stream: ends with an error event
        with stream_under_way(rt, prefix + [13], 2000, on=victim) as (first, chunks):
            victim.process.kill()
            rest = b"".join(chunks)
        last_event = rest.strip().split(b"\n\n")[-1]
        assert json.loads(last_event.removeprefix(b"data: "))["error"]["type"] == "upstream_error"

        # requests for the victim's prefix now succeed on the survivor, with no client error
        for i in range(3):
            resp = post(rt.url, {"prompt": prefix + [20 + i], "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvtier-replica"] == survivor.url

        # the dead replica's index entries are purged
        for _ in range(100):
            if victim.url not in rt.call(lambda: rt.router.index.replicas()):
                break
            time.sleep(0.1)
        assert victim.url not in rt.call(lambda: rt.router.index.replicas())

        # restarted, it is healthy again and its entries come back from fresh events
        victim.restart()
        for _ in range(100):
            if rt.call(lambda: rt.router.replicas[victim.url].healthy):
                break
            time.sleep(0.1)
        for seed in range(20):
            resp = post(rt.url, {"prompt": token_prompt(1000 + seed, 2 * BLOCK), "max_tokens": 2})
            assert resp.status_code == 200
            if resp.headers["x-kvtier-replica"] == victim.url:
                break
        for _ in range(100):
            if victim.url in rt.call(lambda: rt.router.index.replicas()):
                break
            time.sleep(0.1)
        assert victim.url in rt.call(lambda: rt.router.index.replicas())


def failovers_off(rt: RouterThread, replica: Engine) -> float:
    text = httpx.get(rt.url + "/metrics", timeout=10).text
    return metric_in(text, "kvtier_router_failovers_total", {"replica": replica.url})


def test_a_stopped_replica_finishes_its_stream_while_new_requests_fail_over(
    engines: list[Engine], tokenizer: Tokenizer
) -> None:
    """SIGTERM to a replica's API server (what `ServerProcess.stop` and a kubelet send): vLLM
    drains, /health still 200. The stream in flight ends complete; the first request sent
    meanwhile for a prefix the replica holds is refused there (vLLM cuts it short at once) and
    answered by the other replica, which then gets the next ones straight away."""
    with RouterThread(router_config(engines, "kvaware", events=True), tokenizer) as rt:
        prefix, victim, survivor = place_prefix(rt, engines, seed=8, blocks=8)
        placed = (place_prefix(rt, engines, seed, blocks=8) for seed in range(9, 19))
        other_prefix = next(p for p, holder, _ in placed if holder is victim)
        with stream_under_way(rt, prefix + [13], 200, on=victim) as (first, chunks):
            log = victim.spec.log_path
            assert log is not None
            seen = log.stat().st_size
            victim.process.terminate()
            deadline = time.monotonic() + 30
            while b"draining in-flight requests count=1" not in log.read_bytes()[seen:]:
                assert time.monotonic() < deadline, "vLLM did not start draining"
                time.sleep(0.1)
            assert httpx.get(victim.url + "/health", timeout=10).status_code == 200
            before = failovers_off(rt, victim)
            resp = post(rt.url, {"prompt": prefix + [21], "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvtier-replica"] == survivor.url
            assert failovers_off(rt, victim) == before + 1  # it went there first
            # refused once, the victim stays out of rotation through good health checks (and
            # the probes it refuses), so a request for another prefix it holds, streamed (vLLM
            # would refuse it with an empty stream), goes straight to the survivor
            time.sleep(4 * rt.router.config.health_interval_s)
            assert httpx.get(victim.url + "/health", timeout=10).status_code == 200
            assert not rt.call(lambda: rt.router.replicas[victim.url].healthy)
            with stream_under_way(rt, other_prefix + [22], 4, on=survivor) as (head, rest):
                answer = head + b"".join(rest)
            assert json.loads(answer.split(b"\n\n")[-3][6:])["usage"]["completion_tokens"] == 4
            assert failovers_off(rt, victim) == before + 1
            text = httpx.get(rt.url + "/metrics", timeout=10).text
            stopping = "kvtier_router_replica_stopping_total"
            assert metric_in(text, stopping, {"replica": victim.url}) == 1
            sse = first + b"".join(chunks)
        assert sse.endswith(b"data: [DONE]\n\n"), sse[-300:]
        events = [json.loads(e.removeprefix(b"data: ")) for e in sse.split(b"\n\n")[:-2]]
        assert events[-1]["usage"]["completion_tokens"] == 200
        assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
        # and then it exits on its own
        deadline = time.monotonic() + 60
        while victim.process.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not victim.process.alive()
