import json
from pathlib import Path

import pytest

from kvtier.core.errors import ModelError
from kvtier.tools.embedded_model import (
    PACKAGE,
    VERIFY_EXPECT,
    default_model_dir,
    prepare,
    resolve_model,
)


def test_default_model_is_a_verified_bf16_safetensors_directory() -> None:
    model_dir = Path(resolve_model(None))
    assert model_dir == default_model_dir()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert (model_dir / "model.safetensors").stat().st_size > 200_000_000
    record = json.loads((model_dir / "kvtier-prepared.json").read_text())
    assert record["source"] == PACKAGE
    assert VERIFY_EXPECT in record["verified_answer"]


def test_prepare_is_idempotent_and_leaves_the_weights_untouched() -> None:
    weights = default_model_dir() / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare(quiet=True) == default_model_dir()
    assert weights.stat().st_mtime_ns == before


def test_resolve_model_rejects_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
