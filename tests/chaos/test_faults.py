"""The corruption fault's block rewrites and the soak's growth figures, without a fleet."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.core.codec import HEADER_BYTES, decode_header, encode_header
from kvtier.core.errors import CodecError
from kvtier.core.keys import Namespace
from kvtier.tools.chaos.faults import _foreign
from tests.helpers.l2 import make_block

OWN = Namespace("model-a")


def _block() -> bytes:
    h, meta, payload = make_block(seed=1, index=0, nbytes=256)
    return encode_header(OWN, h, meta, payload) + payload


def test_a_foreign_block_is_valid_under_another_namespace_only() -> None:
    data = _foreign(_block())
    decode_header(data[:HEADER_BYTES], namespace=Namespace("f" * 16))
    with pytest.raises(CodecError):
        decode_header(data[:HEADER_BYTES], namespace=OWN)


def test_a_truncated_block_is_rewritten_without_raising() -> None:
    whole = _block()
    for cut in (0, 10, HEADER_BYTES, HEADER_BYTES + 100):
        data = _foreign(whole[:cut])
        assert data == whole[:cut][::-1]


def test_soak_growth_skips_the_samples_of_a_process_that_was_down() -> None:
    from kvtier.tools.chaos.run import _growth

    samples: list[dict[str, float]] = [{"t": float(t), "router_rss_mib": 100.0} for t in range(8)]
    for s in samples[1:]:
        s["replica0_rss_mib"] = 3000.0  # down (not sampled) in the first sample
    samples[-1]["replica0_rss_mib"] = 3100.0
    samples[-1]["router_rss_mib"] = 110.0
    assert _growth(samples) == {"replica0_rss_mib": 50.0, "router_rss_mib": 5.0}


def test_the_corruption_fault_leaves_no_rewritten_block_behind(tmp_path: Path) -> None:
    """Blocks it rewrote are removed at restore (the faults after it must not meet them); the
    blocks it did not touch stay."""
    from kvtier.tools.chaos.faults import Corrupt

    files = [tmp_path / f"{name}.kvt" for name in ("a", "b", "c")]
    for f in files:
        f.write_bytes(_block())
    fleet = SimpleNamespace(block_files=lambda: sorted(tmp_path.glob("*.kvt")))
    fault = Corrupt("l2-corrupt", "juicefs", "test", 1.0)
    fault.inject(fleet)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while len(fault._touched) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    fault.recover(fleet)  # type: ignore[arg-type]
    touched = set(fault._touched)
    assert touched
    fault.restore(fleet)  # type: ignore[arg-type]
    assert {f.name for f in fleet.block_files()} == {f.name for f in files} - touched
    assert fault.failed_part(fleet, {f.name for f in files}) == touched  # type: ignore[arg-type]


def test_the_corruption_stops_by_itself_when_it_is_never_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run interrupted during the hold never calls `recover`: the corrupting thread still
    ends, `CORRUPT_OVERRUN_S` after the hold."""
    from kvtier.tools.chaos import faults

    monkeypatch.setattr(faults, "CORRUPT_OVERRUN_S", 0.5, raising=False)
    fleet = SimpleNamespace(block_files=lambda: sorted(tmp_path.glob("*.kvt")))
    fault = faults.Corrupt("l2-corrupt", "juicefs", "test", 0.5)
    fault.inject(fleet)  # type: ignore[arg-type]
    fault._thread.join(5)
    alive = fault._thread.is_alive()
    fault.recover(fleet)  # type: ignore[arg-type]
    assert not alive
