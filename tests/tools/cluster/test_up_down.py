"""`kvtier up` / `kvtier down` end to end: two real replicas, shared L2, the router."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.net.ports import free_port, free_port_range
from kvtier.tools.embedded_model import resolve_model

pytestmark = pytest.mark.engine


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


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
