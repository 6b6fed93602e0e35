"""`kvtier bench tiers` without engines: variants, paired ratios, and the L2-hit breakdown read
from connector metrics (the engine runs themselves are the benchmark, not a test)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvtier.cli import main
from kvtier.core.errors import KvtierError
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings
from kvtier.tools.bench.tiers import (
    PLAIN,
    Bench,
    Row,
    copy_blocks,
    copy_blocks_to_valkey,
    paired_ratios,
    parse_variant,
)
from kvtier.tools.bench.tiers_breakdown import (
    PHASES,
    Breakdown,
    breakdown_rows,
    breakdown_table,
    parse_samples,
    write_chart,
)
from kvtier.tools.bench.tiers_chart import paired_breakdowns
from tests.helpers.l2 import IDENTITY, NAMESPACE, make_block
from tests.helpers.procs import running

if TYPE_CHECKING:
    from kvtier.tools.l2ops.valkey_server import ValkeyServer

METRICS = """\
# HELP kvtier_connector_hit_phase_seconds_total Seconds cache hits spent per phase.
kvtier_connector_hit_phase_seconds_total{engine="0",model_name="m",phase="read"} 0.25
kvtier_connector_hit_phase_seconds_total{engine="1",model_name="m",phase="read"} 0.5
kvtier_connector_hit_phase_seconds_total{engine="0",model_name="m",phase="copy"} 0.125
kvtier_connector_loaded_blocks_total{engine="0",model_name="m",tier="l2"} 19.0
kvtier_connector_load_seconds_sum{engine="0",model_name="m"} 0.05
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 7.0
"""


def test_samples_are_keyed_by_phase_or_tier_and_summed_over_engines() -> None:
    assert parse_samples(METRICS) == {
        "kvtier_connector_hit_phase_seconds_total{phase=read}": 0.75,
        "kvtier_connector_hit_phase_seconds_total{phase=copy}": 0.125,
        "kvtier_connector_loaded_blocks_total{tier=l2}": 19.0,
        "kvtier_connector_load_seconds_sum": 0.05,
    }


def _hit(ttft: float, load: float, **phases: float) -> Breakdown:
    measured = ("lookup", "lookup_wait", "queue", "open", "read", "checksum", "copy", "layer_wait")
    ms = dict.fromkeys(measured, 0.0)
    return Breakdown("kvtier", 2500, ttft, ms | phases, load, 0.0, 19.0)


def test_a_breakdown_adds_up_to_the_ttft() -> None:
    split = _hit(800.0, 50.0, lookup_wait=1.0, queue=4.0, read=20.0, copy=25.0).split()
    assert list(split) == list(PHASES)
    assert split["load_other"] == pytest.approx(5.0)
    assert split["engine"] == pytest.approx(745.0)
    assert sum(split.values()) == pytest.approx(800.0)


def test_the_forward_pass_waiting_for_the_layered_copy_is_not_engine_time() -> None:
    split = _hit(100.0, 10.0, read=8.0, layer_wait=3.0).split()
    assert (split["layer_wait"], split["engine"]) == pytest.approx((3.0, 87.0))
    assert sum(split.values()) == pytest.approx(100.0)


def test_parallel_reads_are_scaled_down_to_the_loads_wall_time() -> None:
    split = _hit(500.0, 40.0, open=30.0, read=40.0, copy=10.0).split()  # 80 thread-ms in 40
    assert (split["open"], split["read"], split["copy"]) == pytest.approx((15.0, 20.0, 5.0))
    assert split["load_other"] == 0.0
    assert sum(split.values()) == pytest.approx(500.0)


def test_rows_take_medians_and_the_chart_is_drawn(tmp_path: Path) -> None:
    rows = breakdown_rows([_hit(t, 50.0, read=20.0) for t in (700.0, 900.0, 800.0)])
    (row,) = rows
    assert (row["breakdown"], row["tokens"], row["runs"]) == ("kvtier", 2500, 3)
    assert row["ttft_ms"] == 800
    assert "kvtier" in breakdown_table(rows)
    write_chart(rows, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_ratios_are_paired_per_prompt() -> None:
    rows = {
        ("kvtier", 512, "cold"): Row("kvtier", 512, "cold", [110.0, 200.0, 300.0]),
        (PLAIN, 512, "cold"): Row(PLAIN, 512, "cold", [100.0, 200.0, 330.0]),
        (PLAIN, 512, "l0"): Row(PLAIN, 512, "l0", [50.0, 50.0, 50.0]),
        ("kvtier-juicefs", 512, "l2_cross"): Row("kvtier-juicefs", 512, "l2_cross", [60.0] * 3),
        ("kvtier-juicefs", 512, "l1"): Row("kvtier-juicefs", 512, "l1", [40.0, 55.0, 60.0]),
    }
    by_name = {r["ratio"]: r for r in paired_ratios(rows, ["kvtier", "kvtier-juicefs"])}
    cold = by_name["kvtier cold / vLLM cold"]
    assert (cold["median"], cold["min"], cold["max"]) == (1.0, pytest.approx(0.909, abs=1e-3), 1.1)
    assert by_name["kvtier-juicefs L2 / vLLM L0"]["median"] == 1.2
    assert by_name["kvtier-juicefs L1 / vLLM L0"]["median"] == 1.1  # its own L1 hits
    assert "kvtier L2 / vLLM L0" not in by_name  # no such row: not invented


def test_variants_are_checked_against_the_connector_settings() -> None:
    assert parse_variant("before:load_staging=false,background_cpus=inherit") == (
        "before",
        {"load_staging": "false", "background_cpus": "inherit"},
    )
    assert parse_variant("r4:l2=juicefs,load_read_threads=4")[1]["l2"] == "juicefs"
    for bad in ("Bad:load_staging=false", "x:no_such_setting=1", "x:l2=nfs", "x:load_read_threads"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_blocks_are_copied_to_another_mount_under_the_same_names(tmp_path: Path) -> None:
    src, dst = tmp_path / "a", tmp_path / "b"
    rel = Path("ns", "ab", "cd", "abcd.kvt")
    (src / rel).parent.mkdir(parents=True)
    (src / rel).write_bytes(b"block")
    copy_blocks(src, dst, [rel])
    copy_blocks(src, dst, [rel])  # already there: left alone
    assert (dst / rel).read_bytes() == b"block"
    assert [p.name for p in (dst / rel).parent.iterdir()] == ["abcd.kvt"]


@pytest.mark.valkey
def test_blocks_copied_into_valkey_are_hits_of_the_valkey_tier(
    tmp_path: Path, valkey_server: ValkeyServer
) -> None:
    writer = PosixTier(str(tmp_path), NAMESPACE, IDENTITY.manifest())
    blocks = [make_block(9, i, 4096) for i in range(3)]
    for h, meta, payload in blocks:
        assert writer.put(h, meta, payload).stored
    files = [Path(os.path.relpath(writer.path(h), tmp_path)) for h, _, _ in blocks]
    copy_blocks_to_valkey(tmp_path, valkey_server.url, files)
    reader = ValkeyTier(ValkeyTierSettings(url=valkey_server.url), NAMESPACE)
    got = reader.get_many([h for h, _, _ in blocks])
    assert [bytes(b.payload) if b else None for b in got] == [p for _, _, p in blocks]
    assert reader.stats().corrupt_removed == 0
    reader.close()
    writer.close()


def _run_json(path: Path, ttfts: dict[tuple[int, str], float]) -> str:
    rows: list[dict[str, object]] = [{"meta": "kvtier bench tiers"}]
    for (tokens, system), ttft in ttfts.items():
        (row,) = breakdown_rows([_hit(ttft, 50.0, read=20.0)])
        rows.append({**row, "breakdown": system, "tokens": tokens})
    path.write_text(json.dumps(rows))
    return str(path)


def test_the_before_and_after_chart_pairs_what_both_runs_measured(tmp_path: Path) -> None:
    before = _run_json(
        tmp_path / "a.json",
        {(512, "kvtier"): 300.0, (512, "kvtier-juicefs"): 900.0, (4000, "kvtier"): 400.0},
    )
    after = _run_json(tmp_path / "b.json", {(512, "kvtier-juicefs"): 200.0, (512, "kvtier"): 250.0})
    rows = paired_breakdowns(before, after)
    assert [(r["tokens"], r["breakdown"], r["ttft_ms"]) for r in rows] == [
        (512, "kvtier (before)", 300.0),
        (512, "kvtier (after)", 250.0),
        (512, "kvtier-juicefs (before)", 900.0),
        (512, "kvtier-juicefs (after)", 200.0),
    ]  # 4000 tokens: measured before only, left out
    only = paired_breakdowns(before, after, {"kvtier-juicefs"})
    assert {r["breakdown"] for r in only} == {"kvtier-juicefs (before)", "kvtier-juicefs (after)"}
    chart = tmp_path / "c.png"
    assert (
        main(["bench", "tiers-chart", "--before", before, "--after", after, "--chart", str(chart)])
        == 0
    )
    assert chart.read_bytes()[:4] == b"\x89PNG"


def test_the_chart_refuses_runs_without_breakdowns_or_in_common(tmp_path: Path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"meta": "kvtier bench tiers"}]))
    other = _run_json(tmp_path / "o.json", {(1024, "kvtier"): 100.0})
    one = _run_json(tmp_path / "one.json", {(512, "kvtier"): 100.0})
    with pytest.raises(KvtierError, match="no breakdown rows"):
        paired_breakdowns(str(plain), one)
    with pytest.raises(KvtierError, match="in common"):
        paired_breakdowns(one, other)
    with pytest.raises(KvtierError, match="not a readable"):
        paired_breakdowns(str(tmp_path / "missing.json"), one)


class Frozen:
    """A server as `Bench` holds one: a process group of its own, frozen (SIGSTOP) while
    another server is measured; its stop may be interrupted (a second Ctrl-C)."""

    def __init__(self, interrupted: bool) -> None:
        self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.pid = self.proc.pid
        self.interrupted = interrupted
        os.killpg(self.pid, signal.SIGSTOP)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.interrupted:
            raise KeyboardInterrupt


def test_closing_the_bench_thaws_and_stops_every_server_though_one_stop_is_interrupted() -> None:
    bench = object.__new__(Bench)  # its servers alone: no model, no engines
    bench.servers = {"a": Frozen(interrupted=True), "b": Frozen(interrupted=False)}
    bench.frozen = {"a", "b"}
    servers = list(bench.servers.values())
    try:
        with pytest.raises(KeyboardInterrupt):
            bench.close()
        assert not any(running(server.pid) for server in servers)
        assert bench.servers == {} and bench.frozen == set()
    finally:
        for server in servers:
            server.proc.kill()
            server.proc.wait()
