"""What the chaos load records of each answer, against a fake replica that reports usage like
vLLM (the streamed usage event split across chunks)."""

from __future__ import annotations

import asyncio

from kvtier.net.http_client import HttpPool
from kvtier.tools.bench.client import new_pool, stream_request
from kvtier.tools.chaos.load import Load
from tests.monitoring.fake_vllm import MeteredReplica, metered_fleet

MODEL = "m"


def test_every_answer_records_the_cached_tokens_it_reported() -> None:
    async def scenario() -> None:
        replica = MeteredReplica(model=MODEL, max_model_len=4096, block_tokens=16)
        async with metered_fleet(replica):
            load = Load(replica.url, MODEL, ["a prompt"])
            pool = HttpPool(5.0, 10.0)
            try:
                records = [await load.one(pool, key) for key in load.keys]
            finally:
                pool.close()
            bench = new_pool(10.0)
            try:
                outcome = await stream_request(bench, replica.url, {"model": MODEL, "prompt": "x"})
            finally:
                bench.close()
        assert [r.outcome for r in records] == ["ok"] * 4
        assert [r.cached_tokens for r in records] == [replica.cached_tokens] * 4
        streamed = [r for r in records if r.key.stream]
        assert streamed and all(r.text == "ab" for r in streamed)
        streams_sent = [b for b in replica.received if b.get("stream")]
        assert len(streams_sent) == 3  # the load's 2 and the bench client's 1
        assert all(b["stream_options"] == {"include_usage": True} for b in streams_sent)
        assert outcome.cached_tokens == replica.cached_tokens

    asyncio.run(scenario())
