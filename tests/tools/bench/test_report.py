import json
from pathlib import Path

from kvtier.tools.bench.report import (
    Run,
    errors_note,
    markdown_table,
    paired_note,
    percentile,
    plot,
    repeats_note,
    summarize,
    write_json,
)
from kvtier.tools.bench.workload import Record


def record(
    round_: int, ttft: float, prompt: int, cached: int, reusable: int, error: str | None = None
) -> Record:
    return Record("s", round_, float(round_), ttft, ttft + 100, prompt, cached, reusable, error)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0


def test_summary_counts_served_reusable_tokens_only_up_to_what_was_reusable() -> None:
    run = Run(
        "S2",
        "cfg",
        (
            record(0, 300.0, 500, 0, 0),
            record(1, 100.0, 700, 512, 384),  # served more than reusable: capped at 384
            record(2, 120.0, 900, 256, 640),
            record(3, 0.0, 900, 0, 640, error="boom"),  # errors are excluded from figures
        ),
        {"l1_hit_tokens": 7},
    )
    row = summarize(run)
    assert row["requests"] == 3 and row["errors"] == 1
    assert row["ttft_p50_ms"] == 120.0
    assert row["cached_token_share"] == round(768 / 2100, 4)
    assert row["reusable_token_share_served"] == round((384 + 256) / (384 + 640), 4)
    assert row["l1_hit_tokens"] == 7
    assert row["errors_seen"] == ["boom"]
    assert errors_note([row]) == "Failed requests:\n\n- cfg: 1 failed; boom\n\n"
    assert errors_note([summarize(Run("S2", "clean", (record(0, 1.0, 5, 0, 0),), {}))]) == ""


def test_markdown_table_reports_speed_up_against_the_baseline() -> None:
    rows = [{"config": "base", "ttft_p50_ms": 300.0}, {"config": "fast", "ttft_p50_ms": 100.0}]
    table = markdown_table(rows, baseline="base")
    assert table.splitlines()[2].endswith("| 1.00x |")
    assert table.splitlines()[3].endswith("| 3.00x |")


def test_plots_and_json_are_written(tmp_path: Path) -> None:
    runs = [
        Run("S2", name, (record(0, 300.0, 500, 0, 0), record(1, t, 700, 384, 384)), {})
        for name, t in (("a", 200.0), ("b", 50.0))
    ]
    paths = plot(runs, tmp_path, "S2")
    assert [p.name for p in paths] == ["s2_ttft.png", "s2_ttft_by_round.png", "s2_hit_share.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    write_json([summarize(r) for r in runs], tmp_path / "rows.json")
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["config"] for r in rows] == ["a", "b"]


def test_paired_note_compares_each_request_with_itself_under_the_first_config() -> None:
    def run(label: str, ttfts: list[float], error_at: int | None = None) -> Run:
        records = tuple(
            Record("s", i, 0.0, t, t, 100, 0, 0, "boom" if i == error_at else None)
            for i, t in enumerate(ttfts)
        )
        return Run("S2", label, records, {})

    runs = [
        run("off#1", [100.0, 1000.0, 200.0]),
        run("on#1", [110.0, 1100.0, 220.0]),  # 10% slower on every request
        run("off#2", [300.0, 50.0]),
        run("on#2", [330.0, 55.0], error_at=1),  # a failed request is not paired
    ]
    note = paired_note(runs)
    assert "| on | 4 | 1.100 | 1.100-1.100 |" in note
    assert paired_note(runs[:1]) == ""


def test_repeats_note_gives_median_and_spread_of_each_repeats_figures() -> None:
    rows = [
        {"config": "rr#1", "ttft_p50_ms": 400.0, "reusable_token_share_served": 0.5},
        {"config": "kv#1", "ttft_p50_ms": 100.0, "reusable_token_share_served": 1.0},
        {"config": "rr#2", "ttft_p50_ms": 900.0, "reusable_token_share_served": 0.6},
        {"config": "kv#2", "ttft_p50_ms": 150.0, "reusable_token_share_served": 0.9},
        {"config": "rr#3", "ttft_p50_ms": 300.0, "reusable_token_share_served": 0.4},
        {"config": "kv#3", "ttft_p50_ms": 200.0, "reusable_token_share_served": 0.8},
    ]
    lines = repeats_note(rows).splitlines()
    assert lines[0].startswith("Over 3 repeats")
    # speed-ups are taken within each repeat (4x, 6x, 1.5x), not from the medians' ratio (2.67x)
    assert lines[4] == "| rr | 400.0 (300.0-900.0) | 1.00x (1.00x-1.00x) | 0.500 (0.400-0.600) |"
    assert lines[5] == "| kv | 150.0 (100.0-200.0) | 4.00x (1.50x-6.00x) | 0.900 (0.800-1.000) |"
    assert repeats_note([{"config": "rr", "ttft_p50_ms": 1.0}]) == ""


def test_paired_note_gives_a_dash_for_a_config_with_no_paired_request() -> None:
    ok = Run("S2", "base", (record(0, 100.0, 10, 0, 0), record(1, 120.0, 10, 0, 0)), {})
    failed = Run("S2", "broken", tuple(record(i, 0.0, 10, 0, 0, "boom") for i in range(2)), {})
    assert "| broken | 0 | - | - |" in paired_note([ok, failed])


def test_markdown_table_takes_the_speed_up_within_each_repeat() -> None:
    rows = [
        {"config": "base#1", "ttft_p50_ms": 100.0},
        {"config": "fast#1", "ttft_p50_ms": 50.0},
        {"config": "base#2", "ttft_p50_ms": 200.0},
        {"config": "fast#2", "ttft_p50_ms": 100.0},
    ]
    lines = markdown_table(rows, baseline="base").splitlines()[2:]
    assert [line.rsplit("|", 2)[1].strip() for line in lines] == ["1.00x", "2.00x"] * 2


def test_a_config_with_no_successful_request_is_null_in_json_and_a_dash_in_the_table(
    tmp_path: Path,
) -> None:
    row = summarize(Run("S2", "down", (record(0, 0.0, 10, 0, 0, "boom"),), {}))
    assert "| down | 0 | - | - | - | - |" in markdown_table([row])
    write_json([{**row, "nan": float("nan"), "nested": [{"inf": float("inf")}]}], tmp_path / "r")

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    (doc,) = json.loads((tmp_path / "r").read_text(), parse_constant=strict)
    assert doc["ttft_p50_ms"] is None and doc["nan"] is None and doc["nested"] == [{"inf": None}]
