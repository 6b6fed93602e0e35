import subprocess
import sys

SCRIPT = """
import importlib.metadata as md, os
from kvtier.vllm.launch import patch_vllm_cpu, installed_vllm
patch_vllm_cpu()
dist, version = installed_vllm()
assert md.version("vllm") == version, (md.version("vllm"), version)
from vllm.platforms import current_platform
print(dist, version, os.environ.get("VLLM_TARGET_DEVICE"), current_platform.device_type)
"""


def test_patched_vllm_cpu_reports_its_version_and_the_cpu_platform() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    dist, version, target, device = proc.stdout.split()[-4:]
    assert (dist, version) == ("vllm-cpu", "0.32.0")
    assert target == "cpu" and device == "cpu"
