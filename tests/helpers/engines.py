"""Helpers shared by the connector's engine tests: prompts, servers, greedy completions, metrics.

Every engine here is a real `vllm serve` process on the embedded model, started through
`kvtier.tools.vllm_server` with one pinned thread and the waits of engines sharing a machine
(`SHARED_MACHINE_WAIT`: the tests run several side by side); tests share them through
module-scoped fixtures. `BatchEngine` runs vLLM's offline engine instead, in a process of its
own with the same environment, for prompts that must share a scheduler step.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

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


OUTPUT_MARK = "batch-engine-output: "
"""How `tests.helpers.batch_engine` marks its output lines."""


class BatchEngine:
    """`tests.helpers.batch_engine` on the embedded model with the connector on `l2_dir`, one
    pinned thread; its log (vLLM's output) goes to `log_path`. A context manager: the engine
    exits on leaving it (killed if it does not within a minute)."""

    def __init__(self, model_dir: str, l2_dir: Path, log_path: Path) -> None:
        self._temp = tempfile.TemporaryDirectory(prefix="kvtier-batch-engine-")
        spec = ServerSpec(model=model_dir, port=0, cpu_ids="0", queue_wait=SHARED_MACHINE_WAIT)
        self._log = log_path.open("w")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.batch_engine", model_dir, str(l2_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**spec.environment(self._temp.name), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            start_new_session=True,  # (its engine processes too, for a kill on timeout)
        )
        self._outputs: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._log.write(line)
            if line.startswith(OUTPUT_MARK):
                self._outputs.put(line[len(OUTPUT_MARK) :])
        self._outputs.put(None)  # the engine exited

    def generate(
        self, prompts: list[list[int] | dict[str, Any]], timeout_s: float = 600.0
    ) -> list[list[int]]:
        """Greedy outputs of `prompts` (token ids, or token ids and a cache salt: the module
        docstring of `tests.helpers.batch_engine`), all queued before the engine's next step."""
        return [list(ids) for ids in self._ask(prompts, timeout_s)]

    def abort_after_one_step(self, prompt: list[int], timeout_s: float = 600.0) -> None:
        """Run one engine step with `prompt` alone, then abort it."""
        self._ask({"abort_after_one_step": prompt}, timeout_s)

    def new_weights(self, scale: float, timeout_s: float = 600.0) -> None:
        """Scale the attention layers' input norms in place, then reset vLLM's prefix cache
        and the connector's, as an RLHF weight sync does."""
        self._ask({"new_weights": scale}, timeout_s)

    def _ask(self, doc: object, timeout_s: float) -> Any:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(doc) + "\n")
        self._proc.stdin.flush()
        line = self._outputs.get(timeout=timeout_s)
        assert line is not None, f"the batch engine exited; see {self._log.name}"
        return json.loads(line)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._reader.join(timeout=10)
        self._log.close()
        self._temp.cleanup()
