"""Helpers shared by the connector's engine tests: prompts, servers, greedy completions, metrics.

Every engine here is a real `vllm serve` process on the embedded model, started through
`kvtier.tools.vllm_server` with one pinned thread and the waits of engines sharing a machine
(`SHARED_MACHINE_WAIT`: the tests run several side by side); tests share them through
module-scoped fixtures.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from kvtier.net.ports import free_port
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerProcess, ServerSpec, start_server
from kvtier.vllm import settings as config

MAX_MODEL_LEN = 4096
TINY_CACHE_BLOCKS = 40
"""Engine blocks (128 tokens) of the tiny-L0 engines: 5,120 tokens, so a few prompts evict."""


def kv_transfer_config(**settings: Any) -> dict[str, Any]:
    """`--kv-transfer-config` for the connector with `ConnectorSettings(**settings)`."""
    return config.kv_transfer_config(config.ConnectorSettings(**settings))


def start(
    model_dir: str,
    log_dir: Path,
    name: str,
    *,
    connector: Mapping[str, Any] | None = None,
    tiny_cache: bool = False,
    cpu_ids: str = "0",
) -> ServerProcess:
    extra = ["--num-gpu-blocks-override", str(TINY_CACHE_BLOCKS)] if tiny_cache else []
    spec = ServerSpec(
        model=model_dir,
        port=free_port(),
        kv_transfer_config=connector,
        max_model_len=MAX_MODEL_LEN,
        threads=1,
        cpu_ids=cpu_ids,
        queue_wait=SHARED_MACHINE_WAIT,
        extra_args=extra,
        env={"VLLM_SERVER_DEV_MODE": "1"},
        log_path=log_dir / f"{name}.log",
    )
    return start_server(spec, timeout_s=600)


def complete(
    server: ServerProcess, tokens: list[int], max_tokens: int = 12, cache_salt: str | None = None
) -> list[int]:
    """Greedy completion of a token-id prompt; returns the generated token ids."""
    body: dict[str, Any] = {
        "model": Path(server.spec.model).name,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
    resp.raise_for_status()
    return list(resp.json()["choices"][0]["token_ids"])


def reset_l0(server: ServerProcess, timeout_s: float = 60.0) -> None:
    """Empty vLLM's own prefix cache (L0) only; the connector's tiers keep their blocks. vLLM
    refuses while blocks are in use, and a finished request keeps its blocks until the
    connector has saved them, so a refusal is asked again until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.post(server.url + "/reset_prefix_cache", timeout=60)
        resp.raise_for_status()
        if resp.json().get("success", True) is not False:
            return
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.2)


def metric(server: ServerProcess, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of Prometheus metric `name` (matching `labels`) on /metrics."""
    return metric_in(httpx.get(server.url + "/metrics", timeout=60).text, name, labels)


def metric_in(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of metric `name` (matching `labels`) in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if not m:
            continue
        if labels and not all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            continue
        total += float(m.group(2))
    return total
