"""Benchmark S3's workload, peer commands and overhead reference (the run itself needs engines:
`kvtier bench router`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.errors import KvtierError
from kvtier.net.ports import free_port
from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.bench import router as bench_router
from kvtier.tools.bench import router_peers
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.bench.router import measure_overhead, run_workload
from kvtier.tools.bench.router_peers import (
    PASSTHROUGH,
    ROUTERS,
    Replica,
    RouterProcess,
    router_command,
    start_fake_replica,
    stop_fake_replica,
)
from kvtier.tools.bench.router_workload import Workload, build_workload, ideal_hit_tokens
from tests.helpers.procs import running, stops_with_its_starter

BLOCK = 128


def test_workload_interleaves_rounds_and_counts_the_ideal_hits(tokenizer: Tokenizer) -> None:
    tok = tokenizer.hf
    workload = build_workload(
        tok, Corpus(tok), "t", prefixes=4, suffixes=3, prefix_tokens=256, block_tokens=BLOCK
    )
    assert len(workload.prompts) == 12
    heads = [p.split(".\n", 1)[0] for p in workload.prompts]
    for r in range(3):  # every prefix once per round
        assert Counter(heads[4 * r : 4 * r + 4]) == {f"Document t-{p}": 1 for p in range(4)}
    # each repeat can hit at most its 2 full 128-token prefix blocks
    assert workload.ideal_hit_tokens == 4 * 2 * 256


def test_unique_contexts_leave_only_the_prefix_shared(tokenizer: Tokenizer) -> None:
    tok = tokenizer.hf
    workload = build_workload(
        tok,
        Corpus(tok),
        "t",
        prefixes=2,
        suffixes=2,
        prefix_tokens=256,
        suffix_tokens=300,
        block_tokens=BLOCK,
    )
    first, repeat = workload.prompts[0], workload.prompts[2]
    assert first.split(".\n", 1)[0] == repeat.split(".\n", 1)[0]  # the same document
    assert len(tok.encode(repeat)) > 256 + 300 - 20
    assert workload.ideal_hit_tokens == 2 * 256  # the contexts differ: only the prefix can hit


def test_ideal_hits_count_full_blocks_shared_with_any_earlier_request() -> None:
    a = list(range(3 * BLOCK))
    b = a[: 2 * BLOCK] + [7] * BLOCK  # shares 2 blocks with a
    c = a[:BLOCK] + [9] * 2 * BLOCK  # shares 1 with a and b
    assert ideal_hit_tokens([a], BLOCK) == 0
    assert ideal_hit_tokens([a, b, c], BLOCK) == (2 + 1) * BLOCK
    assert ideal_hit_tokens([a, a], BLOCK) == 2 * BLOCK  # the last token is always computed


def test_a_system_prompt_opens_every_prompt_and_counts_for_first_requests(
    tokenizer: Tokenizer,
) -> None:
    tok = tokenizer.hf
    plain = build_workload(
        tok, Corpus(tok), "t", prefixes=4, suffixes=2, prefix_tokens=256, block_tokens=BLOCK
    )
    shared = build_workload(
        tok,
        Corpus(tok),
        "t",
        prefixes=4,
        suffixes=2,
        prefix_tokens=256,
        system_tokens=256,
        block_tokens=BLOCK,
    )
    system = shared.prompts[0].split("Document t-", 1)[0]
    assert system.startswith("System t.") and all(p.startswith(system) for p in shared.prompts)
    assert [p[len(system) :] for p in shared.prompts] == list(plain.prompts)
    # every prompt after the first can hit the system prompt's 2 blocks; repeats also their
    # document's 2
    assert shared.ideal_hit_tokens == 7 * 256 + plain.ideal_hit_tokens


def test_every_router_has_a_command_on_the_given_port() -> None:
    replicas = [Replica("http://127.0.0.1:1", "ipc:///a"), Replica("http://127.0.0.1:2")]
    for name in ROUTERS:
        cmd = router_command(name, replicas, 4242)
        assert "4242" in cmd and "http://127.0.0.1:2" in " ".join(cmd)
    assert "http://127.0.0.1:1=ipc:///a" in router_command("kvtier-kvaware", replicas, 1)


def test_rust_routers_get_their_own_loopback_metrics_port() -> None:
    replicas = [Replica("http://127.0.0.1:1"), Replica("http://127.0.0.1:2")]
    ports = []
    for name in ("sglang-router", "vllm-router"):
        cmd = router_command(name, replicas, 4242)
        assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
        ports.append(cmd[cmd.index("--prometheus-port") + 1])
    assert len(set(ports)) == 2 and "29000" not in ports


def test_passthrough_reference_forwards_and_is_measured(tmp_path: Path) -> None:
    fake, url = start_fake_replica(tmp_path)
    passthrough = RouterProcess(PASSTHROUGH, [Replica(url)], tmp_path)
    try:
        asyncio.run(passthrough.ready(30))
        figures = asyncio.run(
            measure_overhead({PASSTHROUGH: passthrough.url}, url, ["a b c"], pairs=20)
        )
        streaks = asyncio.run(
            measure_overhead(
                {PASSTHROUGH: passthrough.url, "direct": url},
                url,
                ["a b c"],
                pairs=20,
                streak=7,
                prefix="overhead_cold",
            )
        )
    finally:
        passthrough.stop()
        os.killpg(fake.pid, signal.SIGKILL)
        fake.wait()
    row = figures[PASSTHROUGH]
    assert 0 < row["overhead_p50_ms"] <= row["overhead_p99_ms"] < 1000
    assert set(streaks) == {PASSTHROUGH, "direct"}
    assert set(streaks["direct"]) == {"overhead_cold_p50_ms", "overhead_cold_p99_ms"}
    assert streaks["direct"]["overhead_cold_p50_ms"] < row["overhead_p50_ms"]  # no hop at all


class _Metrics(BaseHTTPRequestHandler):
    """A replica's `/metrics` with the two vLLM counters the workload reads, both at zero."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook
        body = b"vllm:prefix_cache_hits_total 0.0\nvllm:request_success_total 0.0\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_router_that_answers_no_request_has_no_ttft(metrics_replica: str) -> None:
    router = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request fails
    row = asyncio.run(
        run_workload(router, [metrics_replica], "m", Workload(("a", "b"), 0), concurrency=2)
    )
    assert row["failed"] == 2 and "error" in row
    assert row["ttft_p50_ms"] is None  # JSON null, not NaN


def test_a_fake_replica_that_does_not_come_up_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def never_ready(url: str, timeout_s: float, *, exited: Any, what: str) -> None:
        started.append(exited.__self__)  # the fake's Popen (`exited` is its poll)
        raise KvtierError(f"{what} did not answer")

    monkeypatch.setattr(router_peers, "wait_ready", never_ready)
    try:
        with pytest.raises(KvtierError):
            start_fake_replica(tmp_path)
        assert started and not running(started[0].pid)
    finally:
        for proc in started:
            stop_fake_replica(proc)


_STARTER = """
import sys
from pathlib import Path
from kvtier.tools.bench.router_peers import start_fake_replica
proc, url = start_fake_replica(Path(sys.argv[1]))
print(proc.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_fake_replica_whose_benchmark_dies_stops_itself(tmp_path: Path) -> None:
    """The benchmark SIGKILLed (out of memory, say): its fake, in a session of its own, must not
    run on holding its port."""
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    fake = 0
    try:
        assert starter.stdout is not None
        fake = int(starter.stdout.readline())
        assert running(fake) and stops_with_its_starter(starter, fake, within_s=15)
    finally:
        starter.kill()
        starter.wait(10)
        if fake and running(fake):
            os.killpg(fake, signal.SIGKILL)


def test_the_bench_kills_its_fakes_when_the_replicas_fail_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from kvtier.tools import embedded_model
    from kvtier.tools.bench import corpus

    fakes: list[subprocess.Popen[bytes]] = []

    def fake(work_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
        fakes.append(start_fake_replica(work_dir)[0])
        return fakes[-1], "http://127.0.0.1:1"

    def no_replicas(*_args: object) -> None:
        raise KvtierError("vLLM server did not start")

    monkeypatch.setattr(embedded_model, "resolve_model", lambda _model: str(tmp_path / "m"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda _dir: None)
    monkeypatch.setattr(corpus, "Corpus", lambda _tokenizer: None)
    monkeypatch.setattr(bench_router, "start_fake_replica", fake)
    monkeypatch.setattr(bench_router, "start_replicas", no_replicas)
    args = argparse.Namespace(model=None, work_dir=str(tmp_path), engine_blocks=None)
    try:
        with pytest.raises(KvtierError, match="did not start"):
            bench_router._cmd(args)
        assert len(fakes) == 2 and not any(running(p.pid) for p in fakes)
    finally:
        for proc in fakes:
            stop_fake_replica(proc)
