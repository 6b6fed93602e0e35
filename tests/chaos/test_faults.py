"""The corruption fault's block rewrites and the soak's growth figures, without a fleet."""

from __future__ import annotations

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
