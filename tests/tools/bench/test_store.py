"""`kvtier bench store` runs end to end on tiny blocks and writes every promised figure, on
a directory, a started Valkey server and a started JuiceFS volume."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import cast

import pytest

from kvtier.cli import main
from kvtier.core.errors import ConfigError
from kvtier.tools.bench.l2 import l2_target
from kvtier.tools.bench.store_passes import EMBEDDED, StoreBenchConfig, geometry_of
from kvtier.tools.l2ops.juicefs import fuse_available, mounted_under

FIGURES = (
    "l1_put_gbps",
    "l1_get_gbps",
    "memcpy_gbps",
    "l2_write_gbps",
    "l2_read_gbps",
    "raw_write_gbps",
    "raw_read_gbps",
    "l1_put_ratio",
    "l1_get_ratio",
    "l2_write_ratio",
    "l2_read_ratio",
)
READ_INTO = ("l2_read_into_gbps", "raw_read_into_gbps", "l2_read_into_ratio")
"""The connector's path, measured on directory targets (not on Valkey)."""
READ_BATCH = ("l2_read_batch_gbps", "raw_read_batch_gbps", "l2_read_batch_ratio")
"""The store's batched load, measured on Valkey targets."""


def test_cli_writes_all_figures_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "store.json"
    l2_root = tmp_path / "l2"
    l2_root.mkdir()
    code = main(
        [
            "bench",
            "store",
            "--json",
            str(out),
            "--l2",
            f"posix:{l2_root}",
            "--block-tokens",
            "4",
            "--blocks",
            "16",
            "--repeats",
            "2",
            "--quiet",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    for key in FIGURES + READ_INTO:
        assert result[key] > 0, key
    assert result["block_bytes"] == EMBEDDED.block_bytes(4) == 30 * 2 * 4 * 3 * 64 * 2
    assert result["blocks_per_pass"] == 16
    assert {len(v) for v in result["per_repeat_gbps"].values()} == {2}
    assert isinstance(result["meets_target"], bool)
    assert list(l2_root.iterdir()) == []  # the benchmark directory was removed
    assert "l2_read_ratio" in capsys.readouterr().out


@pytest.mark.parametrize(
    "target",
    [
        pytest.param("valkey", marks=pytest.mark.valkey),
        pytest.param("valkey-aof", marks=pytest.mark.valkey),
        pytest.param("valkey-cluster", marks=pytest.mark.valkey),
        pytest.param(
            "juicefs",
            marks=[
                pytest.mark.juicefs,
                pytest.mark.skipif(
                    not fuse_available(), reason="FUSE mounts need root + /dev/fuse"
                ),
            ],
        ),
    ],
)
def test_cli_benchmarks_a_started_l2_target_next_to_its_raw_operations(
    target: str, tmp_path: Path
) -> None:
    out = tmp_path / f"{target}.json"
    before = set(Path(tempfile.gettempdir()).glob(f"kvtier-bench-{target}-*"))
    code = main(
        [
            "bench",
            "store",
            "--json",
            str(out),
            "--l2",
            target,
            "--block-tokens",
            "4",
            "--blocks",
            "16",
            "--repeats",
            "2",
            "--quiet",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    extra = READ_INTO if target == "juicefs" else READ_BATCH
    for key in FIGURES + extra:
        assert result[key] > 0, key
    assert not (set(READ_INTO + READ_BATCH) - set(extra)) & set(result)
    assert result["l2"] == target
    # the server (and the mounts) were stopped and their scratch directory removed
    assert set(Path(tempfile.gettempdir()).glob(f"kvtier-bench-{target}-*")) == before
    assert [m for m in mounted_under(tempfile.gettempdir()) if "kvtier-bench" in m] == []


def test_cli_rejects_an_unknown_l2_target(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "store", "--l2", "nfs"])
    assert "posix:PATH, juicefs, valkey, valkey-aof or valkey-cluster" in capsys.readouterr().err


@pytest.mark.valkey
@pytest.mark.parametrize(("target", "appendonly"), [("valkey", "no"), ("valkey-aof", "yes")])
def test_the_valkey_targets_differ_only_in_the_append_only_file(
    target: str, appendonly: str
) -> None:
    import valkey

    with l2_target(target) as started:
        assert started.url is not None
        client = valkey.Valkey.from_url(started.url)
        config = cast("dict[str, str]", client.config_get("append*"))
        client.close()
    assert config["appendonly"] == appendonly
    assert config["appendfsync"] == "everysec"  # the server's default, and l2CachePersistent's


def test_embedded_block_is_the_documented_size() -> None:
    assert EMBEDDED.block_bytes(256) == 5_898_240


def test_geometry_is_read_from_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 512,
            }
        )
    )
    geometry = geometry_of(str(tmp_path))
    assert (geometry.layers, geometry.kv_heads, geometry.head_dim) == (4, 2, 64)
    with pytest.raises(ConfigError, match="model"):
        geometry_of(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"blocks": 12}, "blocks"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"repeats": 0}, "repeats"),
        ({"l2": "posix:"}, "l2"),
        ({"l2": "s3"}, "l2"),
        ({"l2": "valkey", "cold": True}, "cold"),
    ],
)
def test_config_rejects_invalid_fields(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        StoreBenchConfig(**kwargs)  # type: ignore[arg-type]
