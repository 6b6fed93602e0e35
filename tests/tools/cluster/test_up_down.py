"""`kvtier up` / `kvtier down`: end to end (two real replicas, shared L2, the router), and
`kvtier down` against state files naming processes the tests start."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.net.ports import free_port, free_port_range
from kvtier.tools.cluster.state import process_identity
from kvtier.tools.embedded_model import resolve_model


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return str(resp.read().decode())


@pytest.mark.engine
def test_up_serves_through_the_router_and_down_stops_everything(tmp_path: Path) -> None:
    router_port, base_port = free_port(), free_port_range(2)
    config = tmp_path / "fleet.yaml"
    config.write_text(f"""
replicas: 2
intelligentRoutingSpec: {{enabled: true, routingStrategy: kvaware}}
kvCacheSpec:
  enableL1Cache: true
  l1CacheSizeGiB: 1
  enableL2Cache: true
  l2CacheSpec: {{l2CacheBackend: posix, l2CachePath: {tmp_path / "l2"}}}
kvtier: {{routerPort: {router_port}, replicaBasePort: {base_port}, workDir: {tmp_path / "work"}}}
""")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "up", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "endpoint:" in line:
                break
        assert any("endpoint:" in line for line in lines), "".join(lines)[-3000:]
        url = f"http://127.0.0.1:{router_port}"
        model = Path(resolve_model(None)).name
        prompt = "The history of the city, told slowly. " * 60
        first = post(
            url + "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        second = post(
            url + "/v1/completions",
            {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # type: ignore[index]
        details = second["usage"]["prompt_tokens_details"]  # type: ignore[index]
        assert details["cached_tokens"] >= 256  # served from a cache tier the second time
        assert (tmp_path / "work" / "cluster.json").is_file()
        # the router follows each engine's own cache (vLLM's KV events) as well as the tiers'
        deadline = time.monotonic() + 30
        vllm_events = 'kvtier_router_events_total{kind="BlockStored",source="vllm"}'
        while vllm_events not in (metrics := _get(url + "/metrics")):
            assert time.monotonic() < deadline, "\n".join(
                m for m in metrics.split("\n") if "event" in m
            )
            time.sleep(0.5)

        down = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "down", "--config", str(config)],
            check=False,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert down.returncode == 0, down.stderr
        assert proc.wait(timeout=120) == 0
        assert not (tmp_path / "work" / "cluster.json").exists()
        for port in (router_port, base_port, base_port + 1):
            assert not port_open(port), f"port {port} still served after down"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(60)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A deployment file whose work directory is `tmp_path`."""
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"kvtier: {{workDir: {tmp_path}, replicaDrainSeconds: 0, router: {{drain_s: 0}}}}\n"
    )
    return path


def down(config: Path) -> int:
    return main(["down", "--config", str(config)])


@pytest.mark.usefixtures("no_signals")
def test_down_signals_nothing_when_the_state_file_names_another_process(
    config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = config.parent / "cluster.json"
    other = subprocess.Popen(["sleep", "60"])  # has the pid of a `kvtier up` since gone
    try:
        state.write_text(json.dumps({"pid": other.pid, "identity": "another-boot/1"}))
        assert down(config) == 2
        assert other.poll() is None
    finally:
        monkeypatch.undo()  # signals allowed again, to end what the test started
        other.kill()
        other.wait()
    err = capsys.readouterr().err
    assert f"{state} was stale" in err and "signalled nothing" in err
    assert not state.exists()


@pytest.mark.usefixtures("no_signals")
@pytest.mark.parametrize("pid", [1, 0, -1, "1", True, None], ids=repr)
def test_down_refuses_a_state_file_naming_no_process_of_its_own(
    config: Path, capsys: pytest.CaptureFixture[str], pid: object
) -> None:
    state = config.parent / "cluster.json"
    state.write_text(json.dumps({"pid": pid, "identity": process_identity(1)}))
    assert down(config) == 2
    assert "nothing was signalled" in capsys.readouterr().err
    assert state.exists()  # left for the user to remove


@pytest.mark.usefixtures("no_signals")
@pytest.mark.parametrize("text", ['{"pid": 12', "[]", '{"pid": 1234}', "\xff"])
def test_down_reports_a_malformed_state_file(
    config: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    state = config.parent / "cluster.json"
    state.write_text(text, encoding="latin-1")
    assert down(config) == 2
    err = capsys.readouterr().err
    assert f"kvtier: error: {state} is not a state file" in err and "Traceback" not in err


def test_down_stops_the_kvtier_up_that_wrote_the_state_file(config: Path) -> None:
    state = config.parent / "cluster.json"
    # stands for `kvtier up`: on SIGTERM, removes its state file and exits
    owner = subprocess.Popen(
        ["sh", "-c", f"trap 'rm {state}; exit 0' TERM; echo up; while :; do sleep 0.1; done"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "up\n"
        state.write_text(json.dumps({"pid": owner.pid, "identity": process_identity(owner.pid)}))
        assert down(config) == 0
        assert owner.wait(10) == 0
    finally:
        owner.kill()
        owner.wait()
