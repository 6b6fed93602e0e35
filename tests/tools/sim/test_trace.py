"""Loading Mooncake traces: parsing, validation, block hashes and the ideal hit rate."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.keys import BlockHash
from kvtier.tools.sim.trace import block_hash, load_trace
from tests.helpers.sim import MOONCAKE, write_trace


def test_loads_requests_in_arrival_order_with_seconds_and_block_hashes(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [(3000, 600, 5, [0, 7]), (0, 512, 9, [0])])
    trace = load_trace(path)
    assert [r.arrival_s for r in trace] == [0.0, 3.0]
    first, second = trace.requests
    assert (first.input_tokens, first.output_tokens, first.blocks) == (512, 9, (0,))
    assert second.hashes == (block_hash(0), block_hash(7))
    assert trace.block_token_counts(second) == [512, 88]


def test_block_hash_is_sixteen_bytes_little_endian() -> None:
    assert block_hash(1) == BlockHash(b"\x01" + b"\x00" * 15)
    assert block_hash(258) == BlockHash(b"\x02\x01" + b"\x00" * 14)


def test_limit_and_time_scale(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl", [(0, 10, 1, [1]), (1000, 10, 1, [2]), (2000, 10, 1, [3])]
    )
    trace = load_trace(path, limit=2, time_scale=2.0)
    assert [(r.arrival_s, r.blocks) for r in trace] == [(0.0, (1,)), (2.0, (2,))]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
            "1 hash ids for 1000 tokens",
        ),
        ('{"timestamp": 0, "input_length": 10}', "not a Mooncake trace line"),
        ("not json", "not a Mooncake trace line"),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-4]}',
            "hash id outside",
        ),
        (
            '{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [7, 7, 7]}',
            "hash id 7 repeats at block 1",
        ),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [9]}\n' + line + "\n"
    )
    with pytest.raises(ConfigError, match=f"bad.jsonl:2: .*{message}"):
        load_trace(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_trace(tmp_path / "absent.jsonl")


def test_a_directory_or_a_trace_without_requests_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"trace: {tmp_path} is a directory"):
        load_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="empty.jsonl holds no requests"):
        load_trace(tmp_path / "empty.jsonl")


def test_a_gzipped_trace_loads_as_the_plain_one_and_a_truncated_one_is_a_config_error(
    tmp_path: Path,
) -> None:
    plain = write_trace(tmp_path / "t.jsonl", [(0, 600, 5, [0, 7]), (1000, 512, 9, [0])])
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace(packed) == load_trace(plain)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(ConfigError, match="cut.jsonl.gz as JSONL text"):
        load_trace(cut)


def test_the_bundled_trace_is_a_file_of_the_package() -> None:
    import kvtier

    assert MOONCAKE.is_relative_to(Path(kvtier.__file__).parent) and MOONCAKE.is_file()


def test_mooncake_ideal_hit_rate_is_36_6_percent() -> None:
    trace = load_trace(MOONCAKE)
    assert len(trace) == 12_031
    assert trace.total_blocks() == 288_500
    assert round(trace.ideal_hit_rate(), 3) == 0.366


def test_mooncake_blocks_seen_before_always_form_a_prefix() -> None:
    """Chained ids: a request reuses a contiguous prefix, so set hits equal prefix hits."""
    seen: set[int] = set()
    for request in load_trace(MOONCAKE):
        known = [b in seen for b in request.blocks]
        assert known == sorted(known, reverse=True)
        seen.update(request.blocks)
