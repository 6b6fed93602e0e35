"""`kvtier sim` and `kvtier plan` from the command line: help, JSON keys, plots, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.core.errors import ConfigError
from kvtier.tools.sim.report import prepare_output
from tests.helpers.sim import MOONCAKE

REQUIRED = {
    "hit_rate",
    "ideal_hit_rate",
    "hit_rate_by_tier",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "load_max_over_mean",
    "requests",
    "wall_s",
}


@pytest.mark.parametrize(
    "command, phrase",
    [
        ("sim", "discrete-event model of N replicas"),
        ("plan", "how much L1 (or L2, or L0) do I need"),
    ],
)
def test_help_describes_the_command(
    command: str, phrase: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert phrase in " ".join(capsys.readouterr().out.split())


def test_sim_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    code = main(
        [
            "sim",
            "--trace",
            str(MOONCAKE),
            "--limit",
            "500",
            "--replicas",
            "4",
            "--strategy",
            "kvaware",
            "--policy-opt",
            "queue_weight=0.5",
            "--l2-blocks",
            "inf",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert REQUIRED <= doc.keys()
    assert doc["requests"] == 500
    assert doc["config"]["l2_blocks"] == "inf"
    assert doc["config"]["l0_blocks"] == 292  # gpu-7b default: 8 GiB of 512-token blocks
    assert doc["config"]["strategy_options"] == {"queue_weight": 0.5}
    assert "hit rate" in capsys.readouterr().out


def test_sim_without_a_trace_replays_the_bundled_one(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert main(["sim", "--limit", "20", "--json", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["requests"] == 20


def test_sim_sweep_writes_points_and_a_png_beside_the_json(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    code = main(
        [
            "sim",
            "--trace",
            str(MOONCAKE),
            "--limit",
            "300",
            "--replicas",
            "1",
            "--l0-blocks",
            "0",
            "--l2-blocks",
            "0",
            "--costs",
            "cpu-smollm2",
            "--sweep",
            "l1=0,50,inf",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert [p["x"] for p in doc["points"]] == [0, 50, "inf"]
    assert REQUIRED <= doc["points"][0].keys()
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_a_sweep_is_an_error_naming_both_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "run.png"
    code = main(["sim", "--trace", str(MOONCAKE), "--limit", "10", "--plot", str(png), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "--sweep" in err
    assert not png.exists()


def test_plan_prints_the_answer_and_exits_1_when_out_of_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [
        "plan",
        "--trace",
        str(MOONCAKE),
        "--limit",
        "300",
        "--replicas",
        "1",
        "--l0-blocks",
        "0",
        "--l2-blocks",
        "0",
        "--tier",
        "l1",
        "--quiet",
    ]
    out = tmp_path / "plan.json"
    assert main(common + ["--target-hit-rate", "0.05", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["reachable"] and doc["blocks"] > 0 and doc["hit_rate"] >= 0.05
    assert "l1:" in capsys.readouterr().out
    assert main(common + ["--target-hit-rate", "0.99"]) == 1


def test_bad_values_exit_2_with_the_field_named(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", "--trace", str(MOONCAKE), "--limit", "10", "--cost", "warp=9", "--quiet"])
    assert code == 2
    assert "unknown field 'warp'" in capsys.readouterr().err


def test_a_bad_capacity_flag_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "--trace", str(MOONCAKE), "--l1-blocks", "-5"])
    assert exit_info.value.code == 2
    assert "argument --l1-blocks: capacity: must be >= 0, got -5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "--json", "{file}/x.json"],
        ["sim", "--sweep", "l1=0,inf", "--plot", "{file}/x.png"],
        ["plan", "--target-hit-rate", "0.1", "--json", "{file}/sub/x.json"],
    ],
)
def test_an_output_that_cannot_be_written_is_an_error_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    file = tmp_path / "file"
    file.touch()
    argv = [a.format(file=file, tmp=tmp_path) for a in argv]
    assert main([*argv, "--trace", str(MOONCAKE), "--limit", "10", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "kvtier: error: --" in err  # nothing simulated
    assert sorted(tmp_path.iterdir()) == [file]


def test_a_plot_without_a_suffix_is_the_png_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--trace", str(MOONCAKE), "--limit", "10", "--sweep", "l1=0,inf"]
    assert main([*argv, "--plot", str(tmp_path / "curve"), "--quiet"]) == 0
    assert f"plot: {tmp_path / 'curve.png'}" in capsys.readouterr().out
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_prepare_output_makes_the_directory_or_names_the_flag(tmp_path: Path) -> None:
    prepare_output(tmp_path / "a" / "b.json", "--json")
    prepare_output(tmp_path / "reports", "--report-dir", directory=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "reports"]
    (tmp_path / "file").touch()
    with pytest.raises(ConfigError, match=f"--report-dir {tmp_path}/file: .* not a directory"):
        prepare_output(tmp_path / "file", "--report-dir", directory=True)
    with pytest.raises(ConfigError, match="--json /proc/x/y.json: No such file or directory"):
        prepare_output(Path("/proc/x/y.json"), "--json")
    with pytest.raises(ConfigError, match=f"--plot {tmp_path}/a: is a directory"):
        prepare_output(tmp_path / "a", "--plot")


def test_public_surface_of_the_sim_package_is_pinned() -> None:
    import kvtier.tools.sim

    assert kvtier.tools.sim.__all__ == sorted(kvtier.tools.sim.__all__)
    assert set(kvtier.tools.sim.__all__) == {
        "CostModel",
        "FleetConfig",
        "PlanAnswer",
        "SimResult",
        "SweepAxis",
        "Trace",
        "TraceRequest",
        "load_costs",
        "load_trace",
        "parse_sweep",
        "plan_capacity",
        "run_sweep",
        "simulate",
    }
