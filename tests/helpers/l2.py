"""Shared fixtures and helpers of the L2 tests: real servers, real FUSE mounts, real processes.

Fixtures are module-scoped and always tear down (stop the server, unmount every mount), even
when a test fails. Blocks are synthetic but deterministic: `make_block(seed, i, variant)` gives
the same hash for every variant and a different payload per variant, so a test can tell which
writer's bytes a reader got, and that they were never a mix.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import numpy as np
import pytest

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash, ModelIdentity, Namespace, chain_hash, root_hash
from kvtier.tools.l2ops.juicefs import (
    fuse_available,
)

IDENTITY = ModelIdentity(model="l2-test-model", block_tokens=16)
NAMESPACE: Namespace = IDENTITY.namespace()
TOKENS = 16

needs_fuse = pytest.mark.skipif(not fuse_available(), reason="FUSE mounts need root + /dev/fuse")

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
"""Workers run from the repository root so `tests.helpers.l2_worker` imports wherever pytest ran."""


def block_hash(seed: int, index: int) -> BlockHash:
    """Hash of block `index` of chain `seed` (chained like real blocks)."""
    h = root_hash(seed.to_bytes(8, "little"))
    for i in range(index + 1):
        h = chain_hash(h, [seed, i] * (TOKENS // 2))
    return h


def make_block(
    seed: int, index: int, nbytes: int, variant: int = 0
) -> tuple[BlockHash, BlockMeta, bytes]:
    """A block whose payload depends on (seed, index, variant) and whose hash does not."""
    h = block_hash(seed, index)
    parent = block_hash(seed, index - 1) if index else root_hash(seed.to_bytes(8, "little"))
    rng = np.random.default_rng([seed, index, variant])
    payload = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return h, BlockMeta(num_tokens=TOKENS, dtype="uint8", shape=(nbytes,), parent=parent), payload


def poll(fn: Callable[[], T | None], deadline_s: float, interval_s: float = 0.05) -> T | None:
    """Call `fn` until it returns something truthy or the deadline passes (bounded wait)."""
    end = time.monotonic() + deadline_s
    while True:
        value = fn()
        if value or time.monotonic() >= end:
            return value
        time.sleep(interval_s)


def run_worker(*args: str, timeout_s: float = 120.0) -> dict[str, object]:
    """Run `python -m tests.helpers.l2_worker ARGS` to completion; its JSON report."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.l2_worker", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def spawn_worker(*args: str) -> subprocess.Popen[str]:
    """Start `python -m tests.helpers.l2_worker ARGS` in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.l2_worker", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_worker(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> dict[str, object]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def refuse(
    monkeypatch: pytest.MonkeyPatch,
    module: ModuleType,
    name: str,
    path: str,
    err: int = errno.EACCES,
) -> None:
    """Make `module.name(path, ...)` fail with `err` for `path` alone: the tests run as root,
    which reads everything, so a denial is faked."""
    real = getattr(module, name)

    def call(target: object, *args: object, **kwargs: object) -> object:
        if target == path:
            raise OSError(err, os.strerror(err), target)
        return real(target, *args, **kwargs)

    monkeypatch.setattr(module, name, call)
