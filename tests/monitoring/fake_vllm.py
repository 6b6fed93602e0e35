"""A fake replica that reports like vLLM with the kvtier connector: `usage` with cached tokens
(the streamed usage event split across chunks, as a slow network delivers it) and a /metrics
page with vLLM's and the connector's series, set by the test (`figures`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.tools.fake_replica import FakeReplica, _chunk, _respond, _respond_json

ENGINE = 'engine="0",model_name="smol"'
SERIES = {
    "prompt_tokens": "vllm:prompt_tokens_total{%s}",
    "l0_tokens": 'vllm:prompt_tokens_cached_by_source_total{%s,source="device"}',
    "l1_tokens": 'kvtier_connector_hit_tokens_total{%s,tier="l1"}',
    "l2_tokens": 'kvtier_connector_hit_tokens_total{%s,tier="l2"}',
    "running": "vllm:num_requests_running{%s}",
    "waiting": "vllm:num_requests_waiting{%s}",
    "l0_usage": "vllm:kv_cache_usage_perc{%s}",
    "l1_used_bytes": "kvtier_connector_l1_used_bytes{%s}",
    "l1_capacity_bytes": "kvtier_connector_l1_capacity_bytes{%s}",
    "l2_used_bytes": "kvtier_l2_used_bytes{%s}",
    "l2_capacity_bytes": "kvtier_l2_capacity_bytes{%s}",
    "l2_high_bytes": "kvtier_l2_high_watermark_bytes{%s}",
    "l2_low_bytes": "kvtier_l2_low_watermark_bytes{%s}",
    "l2_blocks": "kvtier_l2_blocks{%s}",
    "l2_lease_held": "kvtier_l2_janitor_lease_held{%s}",
    "l2_evicted_blocks": "kvtier_l2_evicted_blocks_total{%s}",
}


@dataclass
class MeteredReplica(FakeReplica):
    prompt_tokens: int = 300
    cached_tokens: int = 256
    figures: dict[str, float] = field(default_factory=dict)
    """Figure (keys of SERIES) -> value on /metrics."""
    pause_s: float = 0.005
    """Between stream chunks, so the router reads them one by one."""

    def metrics_text(self) -> str:
        lines = [f'vllm:cache_config_info{{block_size="{self.block_tokens}",engine="0"}} 1.0']
        lines += [f"{SERIES[k] % ENGINE} {v}" for k, v in self.figures.items()]
        # noise the dashboard must skip: histograms and comments
        lines += [
            "# HELP vllm:e2e_request_latency_seconds x",
            f'vllm:e2e_request_latency_seconds_bucket{{{ENGINE},le="1.0"}} 3',
        ]
        return "\n".join(lines) + "\n"

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + 2,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def _answer(
        self, writer: asyncio.StreamWriter, method: str, path: str, body: bytes
    ) -> bool:
        if method == "GET" and path == "/metrics":
            await _respond(writer, 200, self.metrics_text().encode(), b"text/plain")
            return True
        return await super()._answer(writer, method, path, body)

    async def _generate(self, writer: asyncio.StreamWriter, body: dict[str, Any]) -> bool:
        self.received.append(body)
        if not body.get("stream"):
            doc = {
                "id": "x",
                "object": "text_completion",
                "choices": [{"text": 'a "usage": {"prompt_tokens": 1}', "index": 0}],
                "usage": self.usage(),
            }
            await _respond_json(writer, 200, doc)
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        usage = b"data: " + json.dumps({"choices": [], "usage": self.usage()}).encode() + b"\n\n"
        half = len(usage) // 2
        events = [
            b'data: {"choices": [{"index": 0, "text": "a"}], "usage": null}\n\n',
            b'data: {"choices": [{"index": 0, "text": "b"}], "usage": null}\n\n',
            usage[:half],
            usage[half:],
            b"data: [DONE]\n\n",
            b"",
        ]
        for event in events:
            await _chunk(writer, event)
            await asyncio.sleep(self.pause_s)
        return True


@contextlib.asynccontextmanager
async def metered_fleet(*replicas: MeteredReplica) -> AsyncIterator[list[MeteredReplica]]:
    """Start `replicas` on free ports; stop them on the way out."""
    for r in replicas:
        await r.start()
    try:
        yield list(replicas)
    finally:
        for r in replicas:
            await r.stop()
