"""`kvtier bench transfer` on CPU (the CUDA run is documented in docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.core.errors import ConfigError
from kvtier.tools.bench.transfer import FIGURES, TransferGeometry, measure
from kvtier.vllm.transfer import PagedKV

SMALL = TransferGeometry(
    layers=2, kv_heads=2, head_size=8, engine_block=4, block_tokens=8, engine_blocks=32
)


def test_a_row_gives_every_figure_and_its_spread_for_verified_copies(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    args = ["bench", "transfer", "--device", "cpu", "--layers", "2", "--kv-heads", "2"]
    args += ["--head-size", "8", "--engine-block", "4", "--block-tokens", "8"]
    args += ["--engine-blocks", "32", "--blocks", "4", "--repeats", "2", "--json", str(out)]
    assert main(args) == 0
    [row] = json.loads(out.read_text())
    assert row["verified"] and row["device"] == "cpu"
    # layers x engine blocks per block x heads x tokens x (K, V of 8) x 2 bytes
    assert row["block_bytes"] == 2 * 2 * 2 * 4 * 16 * 2
    for name in FIGURES:
        low, high = row[f"{name}_gbps_range"]
        assert 0 < low <= row[f"{name}_gbps"] <= high
    assert row["gather_vs_link"] == pytest.approx(row["gather_gbps"] / row["link_d2h_gbps"], 0.01)


def test_a_scatter_that_misses_a_block_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    scatter = PagedKV.scatter

    def drops_the_last_block(self: PagedKV, src: object, ids: list[int], skip: int = 0) -> None:
        scatter(self, src, ids[:-1], skip)  # type: ignore[arg-type]

    monkeypatch.setattr(PagedKV, "scatter", drops_the_last_block)
    with pytest.raises(AssertionError, match="scatter moved wrong bytes"):
        measure(SMALL, "cpu", blocks=2, repeats=1)


def test_geometries_that_cannot_be_measured_are_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError, match="--block-tokens 6: not a multiple"):
        measure(TransferGeometry(engine_block=4, block_tokens=6), "cpu", 1, 1)
    assert main(["bench", "transfer", "--device", "cpu", "--blocks", "100"]) == 2
    assert "raise --engine-blocks" in capsys.readouterr().err
