"""The multi-node shape, on one machine: every replica on its own emulated node (a network
namespace with its own address and its own JuiceFS mount of the shared volume), the router and
Valkey (the JuiceFS metadata engine) on another, a client on a third; the router finds the
replicas through a hosts file giving `kvtier-replicas` several addresses, as cluster DNS gives a
headless Service's. Every request crosses namespaces over real sockets.

Shown, with the figures printed as one JSON line (`multinode:`) for docs/kubernetes.md:
1. a prompt computed on node X is served from L2 on another node through the router, with the
   same greedy output (TTFT cold vs. cross-node L2 hit);
2. a node added to the name while traffic runs is discovered and takes load (delay, failures);
3. a node whose link goes down is dropped within a stated time, no request sent after that
   fails (failures before and after, streamed and not), every answer equals its prompt's first
   (greedy, fp32), and a stream under way on the lost node ends with an error event within
   seconds, not after the read timeout (the chaos suite's figures for this fault,
   docs/reliability.md);
Kept small for CI: 2 replicas + 1 added, one 1,024-token prompt, short traffic requests.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.router.tokenizer import Tokenizer
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.chaos.run import WINDOW, latency_bound, normal_after
from kvtier.tools.l2ops.juicefs import (
    fd_comm_socket,
    find_juicefs_binary,
    force_unmount,
    fuse_available,
    mounted_under,
)
from kvtier.tools.l2ops.valkey_server import find_valkey_binary
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerSpec
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config
from tests.multinode.netns import Network, Node, in_node, require

pytestmark = pytest.mark.engine

PORT = 8000
EVENTS_PORT = 5557
SERVICE = "kvtier-replicas"
PROMPT_TOKENS = 1024
DROP_LIMIT_S = 5.0
"""Link down -> out of the routing set: the check under way, then one failed check (interval
0.5 s, timeout 1 s, `--unhealthy-after 1`); about 2.5 s, the rest is slack for a loaded host."""
LONG_STREAM_TIMEOUT_S = 90.0
"""The client's read timeout for the stream cut by the lost link (it must end well before)."""
CUT_STREAM_LIMIT_S = 8.0
"""Link down -> the stream under way on that node ends with an error event: the node dropped
(above), then one check that finds it silent and taking no connection (two 1 s timeouts)."""
NORMAL_LIMIT_S = 10.0
"""The node out of the routing set -> serving normal again (issue 17's target for a fault)."""
DISCOVERY_LIMIT_S = 5.0
"""Name updated -> routable: one resolution (1 s) + the health probe + the check after it."""


@dataclass
class Sent:
    started: float
    ended: float
    ok: bool
    replica: str | None
    stream: bool
    prompt: int
    text: str = ""
    error: str = ""
    error_event: bool = False
    """A stream that ended with an SSE error event (the router's word that it was cut)."""


TRAFFIC_PROMPTS = 4
"""The traffic cycles over this many prompts, so every answer has a reference to equal."""


class Traffic:
    """Short greedy requests from the client node, two at a time, alternately streamed and
    not, until stopped (bounded)."""

    def __init__(self, client: Node, router: str, model: str, max_s: float = 300.0) -> None:
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._workers = [in_node(client, self._loop, router, model, w, max_s) for w in range(2)]

    def _loop(self, router: str, model: str, worker: int, max_s: float) -> None:
        deadline = time.monotonic() + max_s
        with httpx.Client(timeout=60) as http:
            for i in range(5000):
                if self._stop.is_set() or time.monotonic() > deadline:
                    return
                prompt, stream = (worker + i) % TRAFFIC_PROMPTS, i % 2 == 1
                body = {
                    "model": model,
                    "prompt": f"Question {prompt}: name a colour of the sea.",
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": stream,
                }
                sent = Sent(time.monotonic(), 0.0, False, None, stream, prompt)
                try:
                    _send(http, router, body, sent)
                except httpx.HTTPError as exc:
                    sent.error = repr(exc)
                sent.ended = time.monotonic()
                self.sent.append(sent)

    def stop(self) -> list[Sent]:
        self._stop.set()
        for worker in self._workers:
            worker.result(120)
        return self.sent


def _send(
    http: httpx.Client,
    router: str,
    body: dict[str, Any],
    sent: Sent,
    first_token: threading.Event | None = None,
) -> None:
    """One request; fills `sent` (ok only for a complete answer: 200, and [DONE] if streamed)."""
    with http.stream("POST", router + "/v1/completions", json=body) as resp:
        sent.replica = resp.headers.get("x-kvtier-replica")
        if resp.status_code != 200:
            sent.error = resp.read().decode(errors="replace")
            return
        if not body["stream"]:
            sent.text, sent.ok = json.loads(resp.read())["choices"][0]["text"], True
            return
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                sent.ok = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    sent.error_event, sent.error = True, json.dumps(event["error"])
                elif event.get("choices"):
                    sent.text += event["choices"][0].get("text", "")
                    if first_token is not None:
                        first_token.set()
        if not sent.ok and not sent.error:
            sent.error = "stream ended without [DONE] or an error event"


def long_stream(
    http_timeout_s: float, router: str, body: dict[str, Any], first_token: threading.Event
) -> Sent:
    """One streamed request whose answer is long; sets `first_token` when its first text
    arrives, so a fault can land while it is under way."""
    sent = Sent(time.monotonic(), 0.0, False, None, True, -1)
    with httpx.Client(timeout=http_timeout_s) as http:
        try:
            _send(http, router, {**body, "stream": True}, sent, first_token)
        except httpx.HTTPError as exc:
            sent.error = repr(exc)
    first_token.set()  # also when it failed before any text: the caller goes on
    sent.ended = time.monotonic()
    return sent


def wrong_outputs(sent: list[Sent]) -> int:
    """Complete answers that differ from their prompt's first complete answer (streamed or
    not: the same greedy text)."""
    reference: dict[int, str] = {}
    wrong = 0
    for s in sorted((s for s in sent if s.ok), key=lambda s: s.started):
        wrong += reference.setdefault(s.prompt, s.text) != s.text
    return wrong


def get_json(client: Node, url: str) -> Any:
    return in_node(client, lambda: httpx.get(url, timeout=5).json()).result(15)


def wait_until(what: str, check: Any, timeout_s: float, interval_s: float = 0.1) -> float:
    """Seconds until `check()` is true; fails the test after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(interval_s)
    pytest.fail(f"{what}: not within {timeout_s} s")


def ttft(client: Node, router: str, body: dict[str, Any]) -> tuple[float, str, str, dict[str, Any]]:
    """(seconds to the first streamed token, text, serving replica, usage) of one request."""

    def go() -> tuple[float, str, str, dict[str, Any]]:
        started = time.monotonic()
        first = None
        text, usage = "", {}
        doc = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", router + "/v1/completions", json=doc, timeout=300) as resp:
            assert resp.status_code == 200, resp.read()
            replica = resp.headers["x-kvtier-replica"]
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    first = first or time.monotonic()
                    text += event["choices"][0].get("text", "")
                usage = event.get("usage") or usage
        assert first is not None
        return first - started, text, replica, usage

    return in_node(client, go).result(320)


@pytest.fixture
def network() -> Iterator[Network]:
    require()
    if not fuse_available():
        pytest.skip("JuiceFS mounts need root and /dev/fuse")
    with Network() as net:
        yield net


def test_nodes_share_l2_join_and_leave(
    network: Network, tmp_path: Path, model_dir: str, tokenizer: Tokenizer, corpus: Corpus
) -> None:
    net = network
    ctrl, client = net.node("ctrl"), net.node("client")
    a, b, c = net.node("a"), net.node("b"), net.node("c")
    replicas = [a, b, c]
    url = {n.name: f"http://{n.address}:{PORT}" for n in replicas}
    logs = tmp_path / "logs"
    logs.mkdir()

    def log(name: str) -> Any:
        return open(logs / f"{name}.log", "ab")

    # Valkey on the control node: JuiceFS metadata, reached by every node over the network
    net.spawn(
        ctrl,
        [find_valkey_binary(), "--bind", ctrl.address, "--port", "6379", "--save", "",
         "--appendonly", "no", "--protected-mode", "no", "--maxmemory-policy", "noeviction"],
        log=log("valkey"),
    )  # fmt: skip
    meta = f"redis://{ctrl.address}:6379/1"
    juicefs = find_juicefs_binary()
    wait_until(
        "valkey",
        lambda: in_node(client, _port_open, ctrl.address, 6379).result(5),
        15,
    )
    done = subprocess.run(
        ["nsenter", f"--net={ctrl.netns}", juicefs, "format", meta, "kvtier-l2", "--storage",
         "file", "--bucket", f"{tmp_path}/objects/", "--trash-days", "0"],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    mounts: dict[str, Path] = {}
    daemons: list[subprocess.Popen[bytes]] = []
    engines_tmp = tempfile.mkdtemp(prefix="kvtier-vllm-")  # their IPC sockets, removed below
    try:
        for node in replicas:  # each node its own FUSE daemon, its own caches
            point = tmp_path / f"mnt-{node.name}"
            point.mkdir()
            atexit.register(force_unmount, str(point), juicefs)
            daemon = net.spawn(
                node,
                [juicefs, "mount", meta, str(point), "--no-usage-report", "--no-syslog",
                 "--backup-meta", "0", "--metrics", "127.0.0.1:9567", "--cache-dir",
                 f"{tmp_path}/cache-{node.name}", "--attr-cache", "1s", "--entry-cache", "1s",
                 "--dir-entry-cache", "1s"],
                log=log(f"juicefs-{node.name}"),
            )  # fmt: skip
            daemons.append(daemon)
            mounts[node.name] = point
            wait_until(f"mount {point}", lambda p=point: str(p) in mounted_under(str(p)), 30)
        _fleet(
            net, tmp_path, model_dir, tokenizer, corpus, ctrl, client, replicas, url, mounts, log,
            engines_tmp,
        )  # fmt: skip
    finally:
        net.close()  # engines first, then the FUSE daemons (their mounts then detach)
        for point in mounts.values():
            force_unmount(str(point), juicefs)
        for daemon in daemons:  # stopped by signal, the supervisor leaves its socket behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fd_comm_socket(daemon.pid))
        shutil.rmtree(engines_tmp, ignore_errors=True)


def _port_open(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def _fleet(
    net: Network,
    tmp_path: Path,
    model_dir: str,
    tokenizer: Tokenizer,
    corpus: Corpus,
    ctrl: Node,
    client: Node,
    replicas: list[Node],
    url: dict[str, str],
    mounts: dict[str, Path],
    log: Any,
    engines_tmp: str,
) -> None:
    a, b, c = replicas
    for node in replicas:  # all three start now; c joins the name later
        connector = ConnectorSettings(
            l1_bytes=512 * 1024**2,
            l2_path=str(mounts[node.name]),  # the volume's root, as a pod mounts its claim
            l2_profile="juicefs",
            l2_capacity_bytes=2 * 1024**3,
            events_endpoint=f"tcp://0.0.0.0:{EVENTS_PORT}",
            replica_id=url[node.name],
        )
        spec = ServerSpec(
            model=model_dir,
            port=PORT,
            kv_transfer_config=kv_transfer_config(connector),
            max_model_len=4096,
            cpu_ids="nobind",  # 3 engines on 2 cores: bound, two would share one (see
            # LocalFleet.engine_cpus)
            queue_wait=SHARED_MACHINE_WAIT,
            dtype="float32",  # the hit's greedy answer is compared with the cold one (see
            # kvtier.tools.chaos.fleet.ENGINE_DTYPE)
            extra_args=["--enable-prompt-tokens-details"],
        )
        cmd = spec.command()
        cmd[cmd.index("--host") + 1] = node.address  # the node's address, not loopback
        env = spec.environment(engines_tmp)
        net.spawn(node, cmd, env=env, log=log(f"replica-{node.name}"))
    net.hosts(ctrl, {SERVICE: [a.address, b.address]})
    router_url = f"http://{ctrl.address}:{PORT}"
    net.spawn(
        ctrl,
        [sys.executable, "-m", "kvtier.cli", "router", "--host", ctrl.address,
         "--port", str(PORT), "--model", model_dir, "--strategy", "kvaware",
         "--replicas-dns", f"{SERVICE}:{PORT}", "--replica-events-port", str(EVENTS_PORT),
         "--discovery-interval-s", "1", "--health-interval-s", "0.5", "--health-timeout-s", "1",
         "--unhealthy-after", "1",
         "--connect-timeout-s", "1", "--read-timeout-s", "15", "--consistent-ties"],
        log=log("router"),
        hosts=True,
    )  # fmt: skip

    def healthy() -> list[str]:
        try:
            return list(get_json(client, router_url + "/health")["healthy_replicas"])
        except (httpx.HTTPError, ValueError, TimeoutError):
            return []

    started = time.monotonic()
    wait_until("a and b behind the router", lambda: len(healthy()) == 2, 900, 2.0)
    wait_until(
        "c started",
        lambda: in_node(client, _status, url[c.name] + "/health").result(10) == 200,
        600,
        2.0,
    )
    fleet_up_s = time.monotonic() - started

    # 1. computed on node X, served from L2 on another node, through the router
    ids = tokenizer.hf.encode(corpus.document(PROMPT_TOKENS + 200, seed=15))[:PROMPT_TOKENS]
    model = Path(model_dir).name
    body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    cold_s, cold_text, x, _ = ttft(client, router_url, body)
    others = [n for n in (a, b) if url[n.name] != x]
    assert len(others) == 1, x
    lost = next(n for n in (a, b) if url[n.name] == x)
    blocks = PROMPT_TOKENS // 128
    for node in (a, b, c):  # every node's own mount shows the blocks
        wait_until(
            f"L2 blocks on {node.name}'s mount",
            lambda n=node: len(list(mounts[n.name].rglob("*.kvt"))) >= blocks,
            60,
            0.5,
        )

    # 2. a node joins the name while traffic runs
    traffic = Traffic(client, router_url, model)
    time.sleep(3)
    joined_at = time.monotonic()
    net.hosts(ctrl, {SERVICE: [a.address, b.address, c.address]})
    discovery_s = wait_until("c discovered", lambda: url[c.name] in healthy(), 30)
    time.sleep(4)
    # 3. the node that computed the prompt loses its link, with a long stream under way on it
    under_way = threading.Event()
    long_body = {**body, "max_tokens": 512}
    cut = in_node(client, long_stream, LONG_STREAM_TIMEOUT_S, router_url, long_body, under_way)
    assert under_way.wait(120)
    down_at = time.monotonic()
    net.link(lost, up=False)
    drop_s = wait_until(f"{lost.name} dropped", lambda: x not in healthy(), 30)
    net.hosts(ctrl, {SERVICE: [n.address for n in replicas if n is not lost]})
    time.sleep(4)
    sent = traffic.stop()
    stream_on_lost = cut.result(LONG_STREAM_TIMEOUT_S + 30)

    # the prompt again: another node serves it from L2, the same greedy tokens
    hit_s, hit_text, y, usage = ttft(client, router_url, body)
    assert y != x
    assert hit_text == cold_text
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (blocks - 1) * 128

    during_join = [s for s in sent if joined_at <= s.started < joined_at + discovery_s + 4]
    before_down = [s for s in sent if s.started < down_at]
    after_down = [s for s in sent if s.started >= down_at]
    failed_after = [s for s in after_down if not s.ok]
    in_flight = [s for s in before_down if not s.ok]
    silent_cuts = [s for s in sent if s.stream and not s.ok and not s.error_event]
    wrong = wrong_outputs(sent)
    bound = latency_bound([s.ended - s.started for s in sent if s.ended < down_at and s.ok])
    normal_s = normal_after(sent, down_at, down_at + drop_s, bound, WINDOW)
    on_c = [s for s in sent if s.started >= joined_at + discovery_s and s.replica == url[c.name]]
    figures = {
        "fleet_up_s": round(fleet_up_s, 1),
        "ttft_cold_s": round(cold_s, 3),
        "ttft_cross_node_l2_s": round(hit_s, 3),
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "discovery_delay_s": round(discovery_s, 2),
        "failed_during_join": sum(not s.ok for s in during_join),
        "requests_to_new_node": len(on_c),
        "drop_time_s": round(drop_s, 2),
        "failed_started_after_link_down": len(failed_after),
        "failed_in_flight_at_link_down": len(in_flight),
        "long_stream_on_lost_node": {
            "replica_was_lost_node": stream_on_lost.replica == x,
            "error_event": stream_on_lost.error_event,
            "ended_s_after_link_down": round(stream_on_lost.ended - down_at, 2),
            "error": stream_on_lost.error[:120],
        },
        "requests": len(sent),
        "streamed": sum(s.stream for s in sent),
        "wrong_outputs": wrong,
        "failed_plain_before_after_link_down": [
            sum(not s.ok and not s.stream for s in part) for part in (before_down, after_down)
        ],
        "failed_stream_before_after_link_down": [
            sum(not s.ok and s.stream for s in part) for part in (before_down, after_down)
        ],
        "streams_cut_without_error_event": len(silent_cuts),
        "normal_after_drop_s": normal_s,  # as `kvtier bench chaos` judges it
        "median_request_s": round(statistics.median(s.ended - s.started for s in sent), 3),
        "slowest_after_link_down_s": round(
            max((s.ended - s.started for s in after_down), default=0), 2
        ),
    }
    print("multinode:", json.dumps(figures))
    assert not failed_after, [s.error for s in failed_after][:3]
    assert wrong == 0
    assert not silent_cuts, [s.error for s in silent_cuts][:3]
    assert normal_s is not None and normal_s <= NORMAL_LIMIT_S
    assert {s.prompt for s in sent if s.ok and s.stream} == set(range(TRAFFIC_PROMPTS))
    assert all(s.ended > down_at for s in in_flight)  # only requests under way may fail
    # the stream cut by the lost link: an error event, in bounded time, not a hang
    assert stream_on_lost.replica == x and not stream_on_lost.ok
    assert stream_on_lost.error_event, stream_on_lost.error
    assert "replica unreachable" in stream_on_lost.error
    assert stream_on_lost.ended - down_at <= CUT_STREAM_LIMIT_S  # not the 15 s read timeout
    assert not [s for s in during_join if not s.ok]
    assert on_c, "the added node took no request"
    assert discovery_s <= DISCOVERY_LIMIT_S
    assert drop_s <= DROP_LIMIT_S


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=3).status_code
    except httpx.HTTPError:
        return None
