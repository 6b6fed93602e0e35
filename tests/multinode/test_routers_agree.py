"""Several routers, one view: two routers fed the same traffic, each following every replica's
KV events, send each request to the same replica.

Measured on S3's workload shape (8 documents of 1,024 tokens x 8 questions, interleaved; two
replicas): fake replicas answer at once and publish the blocks of every prompt they serve as
the kvtier connector does (L1 on the replica, L2 in the shared pool, over real ZMQ sockets);
each request is sent to router A, then to router B, and the replicas they picked (the
`x-kvtier-replica` header) are compared.

The routers' seeds (5 and 6) are a pair whose random tie-breaks differ on the first request,
a tie (no cache, no load anywhere): with random ties these two routers agree on 0% of the
requests (each places the first document on a different replica, and the cost history then
mirrors every later choice); with `consistent_ties` on 100%. (Seed pairs 1/2 and 3/4 happen to
agree on that first tie: 100% either way.)
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import httpx

from kvtier.core.events import EventKind
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import EventPublisher
from kvtier.router.app import Router, serving
from kvtier.router.settings import RouterSettings
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.bench.router_workload import build_workload
from kvtier.tools.fake_replica import FakeReplica
from tests.helpers.aio import run
from tests.helpers.router import free_endpoint

BLOCK_TOKENS = 16


async def agreement(tokenizer: Tokenizer, prompts: tuple[str, ...], consistent: bool) -> float:
    async with AsyncExitStack() as stack:
        fakes = []
        for _ in range(2):
            fake = await FakeReplica(model="smol", block_tokens=BLOCK_TOKENS).start()
            stack.push_async_callback(fake.stop)
            fakes.append(fake)
        endpoints = [free_endpoint() for _ in fakes]
        publishers = {
            f.url: stack.enter_context(EventPublisher(e, f.url))
            for f, e in zip(fakes, endpoints, strict=True)
        }
        urls = []
        for seed in (5, 6):
            config = RouterSettings(
                replicas=[f.url for f in fakes],
                strategy="kvaware",
                events=endpoints,
                consistent_ties=consistent,
                seed=seed,
                health_interval_s=0.5,
            )
            router = Router(config, tokenizer=tokenizer)
            urls.append((await stack.enter_async_context(serving(router, "127.0.0.1", 0))).url)
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        await asyncio.sleep(0.5)  # ZMQ subscriptions connect
        same = 0
        for prompt in prompts:
            body = {"model": "smol", "prompt": prompt, "max_tokens": 2}
            chosen = []
            for url in urls:
                resp = await client.post(url + "/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                chosen.append(resp.headers["x-kvtier-replica"])
            same += chosen[0] == chosen[1]
            hashes = tokenizer.block_hashes(tokenizer.prompt(body, False), BLOCK_TOKENS)
            for replica in set(chosen):  # what the connector of each serving replica publishes
                publishers[replica].publish(EventKind.STORED, Tier.L1, hashes)
                publishers[replica].publish(EventKind.STORED, Tier.L2, hashes)
            await asyncio.sleep(0.05)
        return same / len(prompts)


def test_two_routers_route_the_same_requests_to_the_same_replica(
    tokenizer: Tokenizer, corpus: Corpus
) -> None:
    workload = build_workload(tokenizer.hf, corpus, "agree", 8, 8, 1024, block_tokens=BLOCK_TOKENS)
    same = run(agreement(tokenizer, workload.prompts, consistent=True), timeout_s=120)
    print(f"two routers agree on {same:.1%} of {len(workload.prompts)} requests")
    assert same >= 0.95
