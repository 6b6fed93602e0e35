"""Suite-wide settings and fixtures: never reach a model hub; vLLM in CPU CI mode."""

from __future__ import annotations

import os

import pytest

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
def tokenizer(model_dir: str):  # -> kvtier.router.tokenizer.Tokenizer
    """The embedded model's tokenizer as the router uses it (loaded once per test run)."""
    from kvtier.router.tokenizer import Tokenizer

    return Tokenizer(model_dir)
