import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import build_parser, main


def test_help_lists_every_top_level_command() -> None:
    text = build_parser().format_help()
    for command in ("model", "bench"):
        assert command in text


def test_unknown_command_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "no-such-command"],
                          check=False, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_kvtier_errors_become_a_named_cli_error(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["model", "prepare", "--dir", str(blocker / "model")])
    assert code == 2
    assert "kvtier: error: cannot write the model under" in capsys.readouterr().err


def test_public_surface_is_pinned() -> None:
    assert kvtier.__all__ == sorted(kvtier.__all__)
    assert set(kvtier.__all__) == {
        "BlockHash", "CodecError", "ConfigError", "KvtierError", "ModelError",
        "ModelIdentity", "Namespace", "TierError", "block_hashes"}
