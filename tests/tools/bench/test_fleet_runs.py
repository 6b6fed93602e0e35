"""How a configuration name of `kvtier bench chat|trace|rag` becomes a fleet, and how its
results are written (the fleets replaced by recorded runs)."""

import argparse
import json
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tools.bench import fleet_runs
from kvtier.tools.bench.fleet_runs import config_spec
from kvtier.tools.bench.report import Run
from kvtier.tools.bench.workload import Record
from kvtier.tools.cluster.spec import FleetSpec


@pytest.mark.parametrize(
    ("name", "l0_events"),
    [
        ("kvtier-l1l2-kvaware", True),
        ("kvtier-l1l2-kvaware+no-l0-events", False),
        ("kvtier-l1l2-kvaware+no-l0-events+monitor", False),
    ],
)
def test_a_configuration_may_go_without_vllms_kv_events(
    tmp_path: Path, name: str, l0_events: bool
) -> None:
    spec = config_spec(FleetSpec(), name, tmp_path)
    assert spec.strategy == "kvaware"
    assert spec.local.vllm_kv_events is l0_events
    assert spec.local.work_dir == str(tmp_path / name)


def test_an_unknown_configuration_names_the_suffixes() -> None:
    with pytest.raises(ConfigError, match=r"'kvaware'.*\+no-l0-events and then \+monitor"):
        config_spec(FleetSpec(), "kvaware+no-l0-events", Path("/tmp"))


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        report_dir=str(tmp_path / "report"),
        json=str(tmp_path / "rows.json"),
        scenario_name="S2",
        help_title="multi-round chat",
    )


def _run(label: str, ttft: float, error: str | None = None) -> Run:
    records = tuple(Record("s", i, float(i), ttft, ttft + 10, 100, 0, 0, error) for i in range(3))
    return Run("S2", label, records, {})


def test_the_json_is_written_before_the_report_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(runs: object) -> str:
        raise RuntimeError("a fault in the report")

    monkeypatch.setattr(fleet_runs, "run_scenario", lambda args: [_run("a", 100.0)])
    monkeypatch.setattr(fleet_runs, "paired_note", broken)
    with pytest.raises(RuntimeError, match="a fault in the report"):
        fleet_runs._cmd(_args(tmp_path))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["config"] for r in rows] == ["a"]


def test_a_report_with_repeats_and_a_failed_config_is_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = [
        _run("base#1", 100.0),
        _run("fast#1", 50.0),
        _run("down#1", 0.0, error="boom"),
        _run("base#2", 300.0),
        _run("fast#2", 150.0),
        _run("down#2", 0.0, error="boom"),
    ]
    monkeypatch.setattr(fleet_runs, "run_scenario", lambda args: runs)
    assert fleet_runs._cmd(_args(tmp_path)) == 0
    report = (tmp_path / "report" / "s2_report.md").read_text()
    speed_ups = {
        line.split("|")[1].strip(): line.rsplit("|", 2)[1].strip()
        for line in report.splitlines()
        if line.startswith(("| base#", "| fast#"))
    }
    # each row against the baseline of its own repeat
    assert speed_ups == {"base#1": "1.00x", "fast#1": "2.00x", "base#2": "1.00x", "fast#2": "2.00x"}
    assert "| down | 0 | - | - |" in report  # no paired request: no ratio
    assert len(json.loads((tmp_path / "rows.json").read_text())) == 6
