"""How a cluster's map is read and keys routed (`kvtier.core.tiers.valkey_shards`), on the
replies `CLUSTER SLOTS` gives; the tier on real clusters: test_valkey_cluster.py."""

from __future__ import annotations

from typing import cast

import pytest
import valkey
from valkey.crc import key_slot

from kvtier.core.tiers.valkey import MAX_BULK_DEFAULT, _max_value_bytes
from kvtier.core.tiers.valkey_shards import ShardFault, Shards, _read_map

URL = "rediss://kv%40user:p%3Aw@cfg.example:6380/0?ssl_cert_reqs=none&db=0"


def _slots(*ranges: tuple[int, int, object]) -> list[list[object]]:
    return [[first, last, [host, 7000 + i, b"id"]] for i, (first, last, host) in enumerate(ranges)]


def test_each_node_is_reached_as_the_url_is_with_its_own_address() -> None:
    reply = _slots((0, 8000, b"10.0.0.2"), (8001, 16383, b"::1"))
    ranges, nodes = _read_map(URL, reply)
    assert nodes == [
        "rediss://kv%40user:p%3Aw@10.0.0.2:7000?ssl_cert_reqs=none",
        "rediss://kv%40user:p%3Aw@[::1]:7001?ssl_cert_reqs=none",
    ]
    assert ranges == [(0, 8000, nodes[0]), (8001, 16383, nodes[1])]


@pytest.mark.parametrize("host", [None, b"", b"?"])
def test_a_node_announcing_no_address_is_reached_at_the_urls_host(host: object) -> None:
    (_, _, node), *_ = _read_map(URL, _slots((0, 16383, host)))[0]
    assert node == "rediss://kv%40user:p%3Aw@cfg.example:7000?ssl_cert_reqs=none"


@pytest.mark.parametrize(
    ("url", "reply", "why"),
    [
        ("redis://h:1/2", _slots((0, 16383, b"h")), "database 0 only"),
        ("redis://h:1", [], "serves no slot"),
        ("redis://h:1", [[0, 16383]], "unreadable"),
        ("redis://h:1", [[0, "x", [b"h", 1]]], "unreadable"),
        ("redis://h:1", 7, "unreadable"),
        ("unix:///tmp/v.sock", _slots((0, 16383, b"h")), "unix://"),
    ],
)
def test_a_map_that_cannot_serve_is_a_shard_fault(url: str, reply: object, why: str) -> None:
    with pytest.raises(ShardFault, match=why):
        _read_map(url, reply)


def test_a_key_whose_slot_no_shard_serves_is_a_shard_fault_never_another_shards() -> None:
    shards = Shards([], [(100, 200, 0), (300, 16383, 1)], cluster=True)
    keys = {
        slot: next(f"k{i}" for i in range(100_000) if key_slot(f"k{i}".encode()) == slot)
        for slot in (50, 150, 250, 400)
    }
    assert shards._owner(keys[150]) == 0 and shards._owner(keys[400]) == 1
    for slot in (50, 250):  # below the first range, and in a gap
        with pytest.raises(ShardFault, match=f"slot {slot}"):
            shards._owner(keys[slot])


def test_a_node_announcing_no_address_is_reached_at_the_host_of_the_node_that_answered() -> None:
    (_, _, node), *_ = _read_map(URL, _slots((0, 16383, b"")), answered="redis://10.0.0.9:1")[0]
    assert node == "rediss://kv%40user:p%3Aw@10.0.0.9:7000?ssl_cert_reqs=none"


def test_a_server_out_of_reach_while_asked_its_largest_value_is_a_fault_not_a_default() -> None:
    """Learned once, a default taken for a timeout would stay for good (puts over the server's
    real limit would then each drop the connection)."""

    class Unreachable:
        def config_get(self, name: str) -> None:
            raise valkey.exceptions.TimeoutError("timed out")

    class Refusing:
        def config_get(self, name: str) -> None:
            raise valkey.exceptions.ResponseError("NOPERM")

    with pytest.raises(valkey.exceptions.TimeoutError):
        _max_value_bytes(cast("valkey.Valkey", Unreachable()))
    assert _max_value_bytes(cast("valkey.Valkey", Refusing())) == MAX_BULK_DEFAULT
