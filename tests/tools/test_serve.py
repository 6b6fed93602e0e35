"""`kvtier serve`: what a user sees when vLLM refuses to start."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.net.ports import free_port


@pytest.mark.engine
def test_a_server_that_fails_to_start_is_reported_in_vllms_own_words(
    model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without `--log`, vLLM's output still goes to a file (it went nowhere before), so a bad
    flag passed to vLLM is named in the error, not only "exited with code 2"."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    port = free_port()
    args = ["serve", "--model", model_dir, "--port", str(port), "--start-timeout", "300"]
    assert main([*args, "--", "--no-such-vllm-flag"]) == 2
    err = capsys.readouterr().err
    assert "--no-such-vllm-flag" in err
    assert (tmp_path / "logs" / f"serve-{port}.log").is_file()
