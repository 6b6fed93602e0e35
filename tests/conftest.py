"""Suite-wide settings and fixtures: never reach a model hub; vLLM in CPU CI mode.

Fixtures shared across the tree: the embedded model and its tokenizer, a text corpus, a real
Valkey server, and one JuiceFS volume mounted twice (two "nodes"). Each stops what it started,
also when a test fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvtier.router.tokenizer import Tokenizer
    from kvtier.tools.bench.corpus import Corpus
    from kvtier.tools.l2ops.juicefs import JuiceFSMount
    from kvtier.tools.l2ops.valkey_server import ValkeyServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded model, prepared once (`kvtier model prepare`)."""
    from kvtier.tools.embedded_model import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir: str) -> Tokenizer:
    """The embedded model's tokenizer as the router uses it (loaded once per test run)."""
    from kvtier.router.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def corpus(tokenizer: Tokenizer) -> Corpus:
    """Real text for prompts of exact token lengths (`kvtier.tools.bench.corpus`)."""
    from kvtier.tools.bench.corpus import Corpus

    return Corpus(tokenizer.hf)


@pytest.fixture(scope="module")
def valkey_server() -> Iterator[ValkeyServer]:
    """A loopback Valkey server (512 MiB, allkeys-lru), one per test module."""
    from kvtier.tools.l2ops.valkey_server import ValkeyServerSpec, start_valkey

    server = start_valkey(ValkeyServerSpec(maxmemory_bytes=512 * 1024**2))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def two_mounts(
    tmp_path_factory: pytest.TempPathFactory, valkey_server: ValkeyServer
) -> Iterator[tuple[JuiceFSMount, JuiceFSMount]]:
    """One JuiceFS volume (Valkey metadata, objects in a local dir) mounted twice."""
    from kvtier.tools.l2ops.juicefs import (
        JuiceFSVolume,
        JuiceFSVolumeSpec,
        fuse_available,
        unmount_dead,
    )

    if not fuse_available():
        pytest.skip("FUSE mounts need root + /dev/fuse")
    root = Path(tmp_path_factory.mktemp("juicefs"))
    unmount_dead(str(root.parent.parent))  # mounts orphaned by an earlier, killed run
    volume = JuiceFSVolume(JuiceFSVolumeSpec(root=str(root), meta_url=valkey_server.url + "/1"))
    try:
        yield volume.mount(), volume.mount()
    finally:
        volume.close()
