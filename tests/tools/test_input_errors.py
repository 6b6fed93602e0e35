"""Bad input to `kvtier sim`, `sim-trace` and `status` is an error naming it, not a traceback
(nor a silent misread)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvtier.cli import main

LINE = {"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}
TRACES = {
    "ok.jsonl": json.dumps(LINE),
    "nan.jsonl": json.dumps({**LINE, "timestamp": float("nan")}),
    "inf.jsonl": json.dumps({**LINE, "timestamp": float("inf")}),
    "ids.jsonl": json.dumps({**LINE, "input_length": 100, "hash_ids": "12"}),
}
SIM = ["sim", "--replicas", "1", "--quiet", "--trace"]
AGENTS = ["sim-trace", "agents", "--sessions", "2", "--out"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*SIM, "{tmp}/cut.jsonl.gz"], "trace: cannot read {tmp}/cut.jsonl.gz"),
        ([*SIM, "{tmp}/nan.jsonl"], "nan.jsonl:1: timestamp nan is not a finite number"),
        ([*SIM, "{tmp}/inf.jsonl"], "inf.jsonl:1: timestamp inf is not a finite number"),
        ([*SIM, "{tmp}/ids.jsonl"], "hash_ids: expected a list, got '12'"),
        ([*SIM, "{tmp}/ok.jsonl", "--costs", "{tmp}/no.json"], "costs: cannot read {tmp}/no.json"),
        ([*SIM, "{tmp}/ok.jsonl", "--json", "{tmp}"], "--json {tmp}: is a directory"),
        (
            [*SIM, "{tmp}/ok.jsonl", "--policy-opt", "queue_weight=abc"],
            "policy option: queue_weight='abc' is not a number",
        ),
        ([*AGENTS, "{tmp}"], "cannot write {tmp}: Is a directory"),
        (
            [*AGENTS, "{tmp}/a.jsonl", "--start-window", "inf"],
            "start_window_s: must be positive and finite, got inf",
        ),
        (["status", "--watch", "-1"], "--watch: expected a positive number of seconds, got '-1'"),
    ],
)
def test_bad_input_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    for name, line in TRACES.items():
        (tmp_path / name).write_text(line + "\n")
    cut = gzip.compress(TRACES["ok.jsonl"].encode())[:-12]  # a gzipped trace, truncated
    (tmp_path / "cut.jsonl.gz").write_bytes(cut)
    code: int | str | None
    try:
        code = main([a.format(tmp=tmp_path) for a in argv])
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message.format(tmp=tmp_path) in err
    assert "Traceback" not in err
