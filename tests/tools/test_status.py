"""`kvtier status` against a running router (in-process, fake replicas reporting like vLLM with
the connector): the table, the fleet found through `kvtier up`'s state file, `--watch`, and a
replica going down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.router.tokenizer import Tokenizer
from tests.helpers.aio import run
from tests.helpers.router import completion, running_router
from tests.monitoring.fake_vllm import metered_fleet
from tests.monitoring.test_dashboard import fleet


def status(*argv: str) -> int:
    return main(["status", *argv])


def test_status_prints_replicas_load_hits_by_tier_and_l2(
    tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    async def scenario() -> tuple[str, str]:
        a, b = fleet()
        async with metered_fleet(a, b), running_router(tokenizer, [a, b]) as rr:
            for i in range(4):
                await rr.client.post(rr.url + "/v1/completions", json=completion(f"p{i}"))
            assert await asyncio.to_thread(status, "--url", rr.url) == 0
            state = tmp_path / "cluster.json"
            state.write_text(json.dumps({"pid": 1, "router": rr.url, "replicas": []}))
            assert await asyncio.to_thread(status, "--state", str(state)) == 0
            return a.url, b.url

    a_url, b_url = run(scenario())
    out = capsys.readouterr().out
    first, second = out.split("kvtier fleet")[1:]
    assert first == second  # the same fleet, found through the state file
    lines = first.splitlines()
    assert "strategy prefixaware" in lines[0]
    assert lines[1].startswith("requests 4 (errors 0)")
    header = lines[3].split()
    assert header[:6] == ["replica", "health", "in-flight", "running", "waiting", "routed"]
    line_a = next(line for line in lines if line.startswith(a_url))
    row_a = line_a.split()
    # the lease holder is starred; A serves 50% from L0, 20% L1, 10% L2, computes 20%
    assert row_a[:3] == [a_url, "*", "up"]
    assert row_a[-4:] == ["50.0%", "20.0%", "10.0%", "20.0%"]
    assert " 25.0%   1.0 MiB / 4.0 MiB " in line_a
    row_b = next(line for line in lines if line.startswith(b_url)).split()
    assert row_b[-4:] == ["0.0%", "0.0%", "50.0%", "50.0%"]
    l2 = next(line for line in lines if line.startswith("L2:"))
    assert l2.startswith("L2: 60.0 MiB of 100.0 MiB (60.0%; high 90.0 MiB, low 75.0 MiB)")
    assert "12 blocks" in l2 and "5 evicted" in l2 and f"janitor (*): {a_url}" in l2


def test_watch_redraws_and_a_dead_replica_shows_down(
    tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    async def scenario() -> str:
        a, b = fleet()
        async with metered_fleet(a, b), running_router(tokenizer, [a, b]) as rr:
            await b.stop()
            for _ in range(100):  # health checks every 0.2 s
                if not rr.router.replicas[b.url].healthy:
                    break
                await asyncio.sleep(0.05)
            args = ("--url", rr.url, "--watch", "0.1", "--count", "2")
            assert await asyncio.to_thread(status, *args) == 0
            return b.url

    b_url = run(scenario())
    out = capsys.readouterr().out
    assert out.count("kvtier fleet") == 2
    row_b = next(line for line in out.splitlines() if line.startswith(b_url)).split()
    assert row_b[1:4] == ["DOWN", "(no", "metrics)"]


def test_status_without_a_fleet_says_how_to_get_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert status("--state", str(tmp_path / "cluster.json")) == 2
    err = capsys.readouterr().err
    assert "no running fleet recorded in" in err and "kvtier up" in err
    assert status("--url", "http://127.0.0.1:9") == 2
    assert "cannot read http://127.0.0.1:9/dashboard/data/latest" in capsys.readouterr().err


def status_against(answer: bytes) -> tuple[int, str]:
    """`kvtier status --url` against a loopback server that answers its one request with the
    bytes `answer`, then closes: (the exit status, the URL)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:  # (closing with it unread would reset)
                    request += conn.recv(4096) or b"\r\n\r\n"
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        return status("--url", url), url
    finally:
        listener.close()
        serving.join(5)


@pytest.mark.parametrize(
    "doc",
    [b"{}", b"null", b"[1, 2]", b'{"totals": {}, "time": 1, "strategy": "x", "replicas": []}'],
)
def test_a_document_of_another_shape_is_an_error_naming_the_url(
    doc: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(doc)}\r\n\r\n".encode()
    code, url = status_against(head + doc)
    assert code == 2
    err = capsys.readouterr().err
    assert f"{url}: not a kvtier dashboard document" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"SSH-2.0-OpenSSH_9.0\r\n", "BadStatusLine: SSH-2.0-OpenSSH_9.0)"),
        (b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"totals"', "IncompleteRead"),
    ],
)
def test_a_url_that_does_not_answer_in_http_is_an_error_naming_the_url(
    answer: bytes, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another service on the port (ssh, a database) or a body cut short: a message, exit 2."""
    code, url = status_against(answer)
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot read {url}/dashboard/data/latest: no well-formed HTTP answer" in err
    assert why in err and "Traceback" not in err
