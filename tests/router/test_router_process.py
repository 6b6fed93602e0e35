"""`kvtier router` as a process of its own: transformers without torch, the same tokens; on
SIGTERM it drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.net.ports import free_port
from kvtier.net.readiness import wait_ready
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.fake_replica import SSE_CHUNKS, FakeReplica
from tests.helpers.procs import running, stops_with_its_starter

TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find a word",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}
CASES: list[tuple[dict[str, Any], bool]] = [
    ({"prompt": "The cat sat on the mat. " * 40}, False),
    ({"prompt": "No special tokens, please.", "add_special_tokens": False}, False),
    ({"messages": [{"role": "user", "content": "Hello there! " * 30}]}, True),
    (
        {
            "messages": [
                {"role": "system", "content": "You answer in French."},
                {"role": "user", "content": [{"type": "text", "text": "Bonjour?"}]},
            ],
            "tools": [TOOL],
        },
        True,
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "Count to three."},
                {"role": "assistant", "content": "One, two,"},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        True,
    ),
    (
        {
            "messages": [{"role": "user", "content": "Think first."}],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        True,
    ),
]
_TOKENIZE_WITHOUT_TORCH = """
import json, sys
from kvtier.tools.router_cli import without_torch
without_torch()
from kvtier.router.tokenizer import Tokenizer
tokenizer = Tokenizer(sys.argv[1])
cases = json.load(sys.stdin)
print(json.dumps({
    "torch_loaded": sys.modules.get("torch") is not None,
    "tokens": [tokenizer.request_tokens(body, chat) for body, chat in cases],
}))
"""


def test_without_torch_the_router_tokenizes_every_request_shape_as_with_it(
    tokenizer: Tokenizer, model_dir: str
) -> None:
    assert sys.modules.get("torch") is not None  # this process loaded transformers with torch
    done = subprocess.run(
        [sys.executable, "-c", _TOKENIZE_WITHOUT_TORCH, model_dir],
        input=json.dumps(CASES),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(done.stdout)
    assert out["torch_loaded"] is False
    assert out["tokens"] == [tokenizer.request_tokens(body, chat) for body, chat in CASES]


def test_the_router_command_serves_without_loading_torch(model_dir: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "router", "--port", str(port), "--model"]
            + [model_dir, "--replica", f"http://127.0.0.1:{free_port()}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # /metrics answers 200 once the router serves (its /health is 503: no replica is up)
        wait_ready(f"http://127.0.0.1:{port}/metrics", 120, exited=router.poll, what="the router")
        libraries = Path(f"/proc/{router.pid}/maps").read_text()
        assert "tokenizers" in libraries  # the model's tokenizer is loaded: it serves
        assert "libtorch" not in libraries
    finally:
        router.terminate()
        router.wait(30)


def test_a_terminated_router_lets_its_streams_finish_and_takes_no_new_connection(
    model_dir: str, tmp_path: Path
) -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    replica = asyncio.run_coroutine_threadsafe(FakeReplica("slow_stream").start(), loop).result(10)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "router.log", "wb") as out:
        router = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "router", "--port", str(port), "--model"]
            + [model_dir, "--replica", replica.url, "--drain-s", "20"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_ready(url + "/health", 120, exited=router.poll, what="the router")
        body = {"model": "fake", "prompt": "hello", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
            chunks = stream.iter_raw()
            first = next(chunks)
            router.terminate()
            time.sleep(4)  # past the default drain (2 s): --drain-s 20 holds
            assert router.poll() is None  # still draining
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=5)
            loop.call_soon_threadsafe(replica.release.set)
            sse = first + b"".join(chunks)
        assert sse == b"".join(SSE_CHUNKS)
        assert router.wait(30) == 0  # a clean stop
    finally:
        router.kill()
        router.wait(30)
        asyncio.run_coroutine_threadsafe(replica.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


_PARENT = """
import os, subprocess, sys
from kvtier.core.parent_watch import STOP_WITH_PARENT_ENV
router = subprocess.Popen(
    [sys.executable, "-m", "kvtier.cli", "router", *sys.argv[1:]],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
    env={**os.environ, STOP_WITH_PARENT_ENV: f"{os.getpid()} 5"},
)
print(router.pid, flush=True)
router.wait()
"""


def test_a_router_whose_starter_dies_stops_itself(model_dir: str) -> None:
    """As `kvtier up` starts it (a session of its own): the starter killed (SIGKILL, out of
    memory) must not leave the router running, holding its port."""
    port = free_port()
    args = [
        "--port",
        str(port),
        "--model",
        model_dir,
        "--replica",
        f"http://127.0.0.1:{free_port()}",
    ]
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, *args], stdout=subprocess.PIPE, text=True
    )
    router = 0
    try:
        assert parent.stdout is not None
        router = int(parent.stdout.readline())
        wait_ready(f"http://127.0.0.1:{port}/metrics", 120, exited=parent.poll, what="the router")
        assert stops_with_its_starter(parent, router, within_s=30)
    finally:
        parent.kill()
        parent.wait(10)
        if router and running(router):
            os.kill(router, signal.SIGKILL)
