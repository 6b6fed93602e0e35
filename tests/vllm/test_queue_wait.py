"""How vLLM's engine processes wait for each other's messages (`kvtier.vllm.launch`).

The unit tests run in a subprocess (they import vLLM and change its module); the engine test
shows the change reaches the processes vLLM spawns: an idle worker stops burning its core.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from kvtier.net.ports import free_port
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerProcess, ServerSpec, start_server

TUNE = """
from kvtier.vllm.launch import patch_vllm_cpu, tune_message_queue
patch_vllm_cpu()
from vllm.distributed.device_communicators import shm_broadcast as mq
before = (mq.SpinCondition.__init__.__defaults__, mq.SHM_READER_RECHECK_INTERVAL_MS)
tune_message_queue({})
untouched = (mq.SpinCondition.__init__.__defaults__, mq.SHM_READER_RECHECK_INTERVAL_MS)
tune_message_queue({"KVTIER_VLLM_MQ_SPIN_S": "0.005", "KVTIER_VLLM_MQ_RECHECK_MS": "3"})
after = (mq.SpinCondition.__init__.__defaults__, mq.SHM_READER_RECHECK_INTERVAL_MS)
errors = []
for env in ({"KVTIER_VLLM_MQ_SPIN_S": "fast"}, {"KVTIER_VLLM_MQ_RECHECK_MS": "0"},
            {"KVTIER_VLLM_MQ_SPIN_S": "-1"}):
    try:
        tune_message_queue(env)
    except ValueError as exc:
        errors.append(str(exc))
del mq.SHM_READER_RECHECK_INTERVAL_MS
tune_message_queue({"KVTIER_VLLM_MQ_SPIN_S": "0"})
other_vllm = mq.SpinCondition.__init__.__defaults__
print(before, untouched, after, errors, other_vllm, sep="\\n")
"""


def test_the_environment_sets_both_waits_names_bad_values_and_spares_another_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", TUNE], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, untouched, after, errors, other_vllm = proc.stdout.strip().splitlines()[-5:]
    assert before == untouched == "((1,), 5000)"
    assert after == "((0.005,), 3)"
    assert "KVTIER_VLLM_MQ_SPIN_S='fast': not a number" in errors
    assert "KVTIER_VLLM_MQ_RECHECK_MS='0': must be at least 1" in errors
    assert "KVTIER_VLLM_MQ_SPIN_S='-1': must be at least 0" in errors
    assert other_vllm == "(0.005,)", "a vLLM without these waits must be left as it is"
    assert "this vLLM's message queue has no such waits" in proc.stderr


def _cpu_seconds(server: ServerProcess, name: str) -> float:
    """CPU time used so far by the server's descendant processes called `name`."""
    total = 0.0
    for child in psutil.Process(server.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() == name:
                times = child.cpu_times()
                total += times.user + times.system
    return total


def test_an_idle_worker_sleeps_on_a_shared_machine(model_dir: str, tmp_path: Path) -> None:
    """vLLM's worker busy-waits a second after each step; with `SHARED_MACHINE_WAIT` it sleeps,
    so the second after an answer costs it a small share of a core instead of all of it."""
    spec = ServerSpec(
        model=model_dir,
        port=free_port(),
        max_model_len=2048,
        queue_wait=SHARED_MACHINE_WAIT,
        log_path=tmp_path / "server.log",
    )
    server = start_server(spec, timeout_s=600)
    try:
        body = {
            "model": Path(model_dir).name,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0.0,
        }
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
        resp.raise_for_status()
        assert resp.json()["usage"]["completion_tokens"] == 8
        time.sleep(0.1)
        start, t0 = _cpu_seconds(server, "VLLM::Worker"), time.monotonic()
        time.sleep(1.0)
        used = (_cpu_seconds(server, "VLLM::Worker") - start) / (time.monotonic() - t0)
        assert start > 0, "no VLLM::Worker process found in the server's process group"
        assert used < 0.3, f"the idle worker used {used:.0%} of a core"
    finally:
        server.stop()
