"""The Valkey L2 tier against a real loopback Valkey server and real writer processes."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, cast

import pytest
import valkey

from kvtier.core.codec import HEADER_BYTES
from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings, set_if_absent
from kvtier.tools.l2ops.valkey_cluster import ClusterNode, cluster_port
from kvtier.tools.l2ops.valkey_server import ValkeyServer, ValkeyServerSpec, start_valkey
from tests.core.test_codec import reseal
from tests.helpers.l2 import (
    IDENTITY,
    NAMESPACE,
    finish_worker,
    make_block,
    poll,
    run_worker,
    spawn_worker,
)

pytestmark = pytest.mark.valkey

KIB = 1024


def tier_for(server: ValkeyServer) -> ValkeyTier:
    return ValkeyTier(
        ValkeyTierSettings(url=server.url, backoff_initial_s=0.05, backoff_max_s=0.2),
        NAMESPACE,
        IDENTITY.manifest(),
    )


def test_blocks_written_by_another_process_are_hit_in_one_batch(
    valkey_server: ValkeyServer,
) -> None:
    report = run_worker(
        "write",
        f"valkey:{valkey_server.url}",
        "--seed",
        "1",
        "--count",
        "8",
        "--bytes",
        str(256 * KIB),
    )
    assert report == {"stored": 8, "already_present": 0, "errors": 0}
    tier = tier_for(valkey_server)
    hashes = [make_block(1, i, 256 * KIB)[0] for i in range(8)]
    assert tier.contains_many(hashes + [make_block(1, 8, 1)[0]]) == [True] * 8 + [False]
    blocks = tier.get_many(hashes)
    assert [bytes(b.payload) for b in blocks if b] == [
        make_block(1, i, 256 * KIB)[2] for i in range(8)
    ]
    assert blocks[3] is not None and blocks[3].meta == make_block(1, 3, 256 * KIB)[1]
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.errors) == (8, 0, 0)


def test_keys_are_namespace_and_hash_hex_with_codec_bytes(valkey_server: ValkeyServer) -> None:
    tier = tier_for(valkey_server)
    h, meta, payload = make_block(2, 0, 4 * KIB)
    assert tier.put(h, meta, payload).stored
    raw = cast(
        "bytes | None", valkey.Valkey.from_url(valkey_server.url).get(f"{NAMESPACE}:{h.hex()}")
    )
    assert raw is not None and raw.startswith(b"KVTBLK\r\n") and raw.endswith(payload)
    assert len(raw) == 4096 + len(payload)


def test_set_if_absent_stores_the_pieces_joined_and_never_replaces_a_value(
    valkey_server: ValkeyServer,
) -> None:
    client = valkey.Valkey.from_url(valkey_server.url)
    wide = memoryview(bytearray(range(256)) * 40).cast("H")  # 5,120 elements of 2 bytes
    assert set_if_absent(client, "k", [b"head:", wide, b":end"])
    assert client.get("k") == b"head:" + wide.tobytes() + b":end"
    assert not set_if_absent(client, "k", [b"other"])
    assert client.get("k") == b"head:" + wide.tobytes() + b":end"
    client.close()


def test_set_if_absent_keeps_its_connection_after_an_error_reply_and_drops_it_after_a_timeout() -> (
    None
):
    """An error reply leaves the connection in step (reused); a timeout leaves a reply on its
    way, so the connection is closed and never answers the next command with it."""
    with ValkeyServer(ValkeyServerSpec(maxmemory_bytes=1024**2, maxmemory_policy="noeviction")) as (
        server
    ):
        assert server.pid is not None
        client = valkey.Valkey.from_url(server.url)
        first = client.client_id()
        with pytest.raises(valkey.exceptions.ResponseError, match="maxmemory"):
            set_if_absent(client, "big", [b"x" * (2 * 1024**2)])
        assert client.client_id() == first
        client.close()
        hasty = valkey.Valkey.from_url(server.url, socket_timeout=0.3)
        first = hasty.client_id()
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(valkey.exceptions.TimeoutError):
                set_if_absent(hasty, "small", [b"late"])
            idle = hasty.connection_pool._available_connections
            assert [conn._sock for conn in idle] == [None]  # closed before the reply came
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # its own reply (the SET may or may not have run), not the SET's late "OK"
        assert hasty.get("small") in (None, b"late")
        assert hasty.client_id() != first
        hasty.close()


def test_concurrent_writers_of_the_same_blocks_publish_once_and_readers_never_see_a_mix(
    valkey_server: ValkeyServer,
) -> None:
    url = f"valkey:{valkey_server.url}"
    common = ["--seed", "3", "--count", "16", "--bytes", str(512 * KIB)]
    reader = spawn_worker("read", url, *common, "--variants", "1,2", "--seconds", "3")
    writers = [spawn_worker("write", url, *common, "--variant", str(v)) for v in (1, 2)]
    reports = [finish_worker(w) for w in writers]
    read = finish_worker(reader)
    assert sum(int(r["stored"]) for r in reports) == 16  # type: ignore[call-overload]
    assert sum(int(r["already_present"]) for r in reports) == 16  # type: ignore[call-overload]
    assert (read["mismatched"], read["corrupt_removed"], read["errors"]) == (0, 0, 0)
    assert int(read["hits"]) > 0  # type: ignore[call-overload]


def test_a_corrupt_value_is_a_miss_and_is_deleted(valkey_server: ValkeyServer) -> None:
    tier = tier_for(valkey_server)
    h, meta, payload = make_block(4, 0, 4 * KIB)
    tier.put(h, meta, payload)
    client = valkey.Valkey.from_url(valkey_server.url)
    client.setrange(f"{NAMESPACE}:{h.hex()}", 4096 + 10, b"\xff\xfe")
    assert tier.get(h) is None
    assert client.exists(f"{NAMESPACE}:{h.hex()}") == 0
    assert tier.stats().corrupt_removed == 1


def test_a_value_with_a_non_ascii_dtype_is_a_removed_miss_and_spares_the_batch(
    valkey_server: ValkeyServer,
) -> None:
    tier = tier_for(valkey_server)
    blocks = [make_block(6, i, 4 * KIB) for i in range(3)]
    for h, meta, payload in blocks:
        tier.put(h, meta, payload)
    client = valkey.Valkey.from_url(valkey_server.url)
    bad = tier.key(blocks[2][0])
    value = bytearray(cast("bytes", client.get(bad)))
    struct.pack_into("<16s", value, 84, b"\xffint8")  # dtype; the header checksum resealed
    client.set(bad, reseal(value[:HEADER_BYTES]) + value[HEADER_BYTES:])
    got = tier.get_many([h for h, _, _ in blocks])
    assert [bytes(b.payload) if b else None for b in got] == [blocks[0][2], blocks[1][2], None]
    assert client.exists(bad) == 0
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.corrupt_removed) == (2, 1, 1)


def test_a_key_of_another_type_is_one_failed_load_then_removed_and_the_block_stored(
    valkey_server: ValkeyServer,
) -> None:
    tier = tier_for(valkey_server)
    blocks = [make_block(9, i, 4 * KIB) for i in range(6)]
    good, hashed, listed, a_set, zset, junk = (tier.key(h) for h, _, _ in blocks)
    tier.put(*blocks[0])
    client = valkey.Valkey.from_url(valkey_server.url)
    client.hset(hashed, "field", "value")
    client.rpush(listed, "item")
    client.sadd(a_set, "member")
    client.zadd(zset, {"member": 1.0})
    client.set(junk, b"not a kvtier block")
    hashes = [h for h, _, _ in blocks]
    # EXISTS finds them all, as the directory tier finds a torn file: the lookup hits once
    assert tier.contains_many(hashes) == [True] * 6
    got = tier.get_many(hashes)
    assert [bytes(b.payload) if b else None for b in got] == [blocks[0][2]] + [None] * 5
    assert client.exists(good) == 1
    assert client.exists(hashed, listed, a_set, zset, junk) == 0
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.corrupt_removed, stats.errors) == (1, 5, 5, 0)
    # the next lookup misses, and the block they were in the way of is stored and served
    assert tier.contains_many(hashes) == [True] + [False] * 5
    assert tier.put(*blocks[1]).stored
    block = tier.get(hashes[1])
    assert block is not None and bytes(block.payload) == blocks[1][2]
    # a plain miss is one TYPE more and removes nothing
    assert tier.get(make_block(9, 6, 1)[0]) is None
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.corrupt_removed, stats.errors) == (2, 6, 5, 0)


def test_no_call_raises_on_a_key_of_another_type_and_wrongtype_is_a_counted_miss(
    valkey_server: ValkeyServer,
) -> None:
    tier = tier_for(valkey_server)
    h, meta, payload = make_block(10, 0, 4 * KIB)
    client = valkey.Valkey.from_url(valkey_server.url)
    client.hset(tier.key(h), "field", "value")
    assert tier.contains(h)
    assert not tier.put(h, meta, payload).stored  # SET NX: the key is taken
    assert tier.remove(h)
    client.hset(tier.key(h), "field", "value")
    assert tier.get(h) is None
    # no command the tier sends answers WRONGTYPE; one that did would be a miss, not a raise
    client.hset(tier.key(h), "field", "value")
    with pytest.raises(valkey.exceptions.ResponseError, match="WRONGTYPE"):
        client.get(tier.key(h))
    key = tier.key(h)
    assert tier._call(lambda s: s.one(key, lambda c: c.get(key)), "get") is None
    assert tier.stats().errors == 1


def test_calls_skipped_during_the_backoff_are_counted_as_errors() -> None:
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tier = ValkeyTier(
        ValkeyTierSettings(
            url=f"redis://127.0.0.1:{port}", backoff_initial_s=3600, backoff_max_s=3600
        ),
        NAMESPACE,
    )
    assert tier.stats().errors == 1  # the first contact, at construction: the backoff starts
    h, meta, payload = make_block(7, 0, 4 * KIB)
    assert not tier.put(h, meta, payload).stored  # skipped
    assert not tier.put(h, meta, payload).stored  # skipped
    assert tier.contains_many([h]) == [False]  # skipped
    assert tier.get_many([h]) == [None]  # skipped
    stats = tier.stats()
    assert (stats.errors, stats.misses) == (5, 1)
    tier.close()


def test_server_restart_mid_run_degrades_to_misses_and_recovers() -> None:
    server = start_valkey()
    try:
        tier = tier_for(server)
        h, meta, payload = make_block(5, 0, 64 * KIB)
        assert tier.put(h, meta, payload).stored
        server.kill()
        # Down: every call answers (misses, failed puts), none raises.
        assert tier.get(h) is None
        assert tier.contains_many([h]) == [False]
        assert not tier.put(h, meta, payload).stored
        assert tier.stats().errors >= 1
        server.start()  # same port, empty (no persistence): a cold but working L2
        assert poll(lambda: tier.put(h, meta, payload).stored, deadline_s=10)
        got = tier.get(h)
        assert got is not None and bytes(got.payload) == payload
    finally:
        server.stop()


def test_a_lookup_on_a_hung_server_costs_the_lookup_timeout_then_the_backoff_answers() -> None:
    """A server that stops answering (frozen, or its network cut) holds an existence check
    `lookup_timeout_s`, not the transfer timeout; the lookups after it are instant misses
    while the backoff lasts; once it answers again, so does the tier."""
    server = start_valkey()
    assert server.pid is not None
    stopped = False
    try:
        tier = ValkeyTier(
            ValkeyTierSettings(
                url=server.url, lookup_timeout_s=0.3, backoff_initial_s=2.0, backoff_max_s=2.0
            ),
            NAMESPACE,
        )
        h, meta, payload = make_block(6, 0, 4 * KIB)
        assert tier.put(h, meta, payload).stored and tier.contains_many([h]) == [True]
        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        started = time.monotonic()
        assert tier.contains_many([h]) == [False]
        assert time.monotonic() - started < 3  # the transfer timeout is 10 s
        started = time.monotonic()
        assert tier.contains_many([h]) == [False]  # in the backoff: not asked
        assert time.monotonic() - started < 0.2
        os.kill(server.pid, signal.SIGCONT)
        stopped = False
        assert poll(lambda: tier.contains_many([h]) == [True] or None, deadline_s=10)
        tier.close()
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.parametrize("appendfsync", [None, "everysec"])
def test_only_a_persistent_server_comes_back_from_a_kill_with_its_blocks(
    tmp_path: Path, appendfsync: Literal["everysec"] | None
) -> None:
    spec = ValkeyServerSpec(data_dir=str(tmp_path / "valkey"), appendfsync=appendfsync)
    with ValkeyServer(spec) as server:
        tier = tier_for(server)
        blocks = [make_block(7, i, 256 * KIB) for i in range(4)]
        assert all(tier.put(*block).stored for block in blocks)
        time.sleep(1.5)  # past the once-a-second sync of everything written
        server.kill()
        assert (tmp_path / "valkey").stat().st_mode & 0o077 == 0  # the blocks are on disk here
        server.start()
        probe = make_block(7, 99, KIB)
        assert poll(lambda: tier.put(*probe).stored, deadline_s=10)  # the tier is back
        got = [tier.get(h) for h, _, _ in blocks]
        if appendfsync is None:
            assert got == [None] * len(blocks)
        else:
            assert [bytes(g.payload) for g in got if g is not None] == [p for _, _, p in blocks]


def test_server_side_lru_keeps_memory_under_maxmemory_and_keeps_the_newest() -> None:
    limit = 16 * 1024**2
    with ValkeyServer(ValkeyServerSpec(maxmemory_bytes=limit)) as server:
        tier = tier_for(server)
        blocks = [make_block(6, i, 1024 * KIB) for i in range(48)]
        for h, meta, payload in blocks:
            tier.put(h, meta, payload)
        present = tier.contains_many([b[0] for b in blocks])
        info = cast("dict[str, object]", valkey.Valkey.from_url(server.url).info("memory"))
        assert info["maxmemory_policy"] == "allkeys-lru"
        assert int(info["used_memory"]) <= limit + 2 * 1024**2  # type: ignore[call-overload]
        assert present[-1] and sum(present) < len(blocks)
        assert tier.stats().errors == 0


def test_a_fault_that_fails_many_calls_at_once_pauses_once_and_one_call_probes() -> None:
    """Calls from several threads in flight when the server hangs fail together: the pause is
    `backoff_initial_s`, not doubled once per call; when it ends one call tries the server and
    the others still skip it, instead of all of them waiting out the timeout together."""
    server = start_valkey()
    assert server.pid is not None
    stopped = False
    now = [0.0]
    threads = 6
    try:
        tier = ValkeyTier(
            ValkeyTierSettings(
                url=server.url, lookup_timeout_s=0.5, backoff_initial_s=1.0, backoff_max_s=60.0
            ),
            NAMESPACE,
            clock=lambda: now[0],
        )
        h, meta, payload = make_block(11, 0, 4 * KIB)
        assert tier.put(h, meta, payload).stored

        def lookups() -> list[float]:
            """Each thread's contains_many, started together: how long each took."""
            barrier = threading.Barrier(threads)

            def one() -> float:
                barrier.wait(timeout=10)
                started = time.monotonic()
                assert tier.contains_many([h]) == [False]
                return time.monotonic() - started

            with ThreadPoolExecutor(threads) as pool:
                futures = [pool.submit(one) for _ in range(threads)]
                return [f.result(timeout=30) for f in futures]

        os.kill(server.pid, signal.SIGSTOP)
        stopped = True
        assert all(t >= 0.4 for t in lookups())  # all in flight, all timed out
        assert tier.stats().errors == threads
        now[0] += 1.0  # the pause of one fault has passed
        took = lookups()
        assert sum(t >= 0.4 for t in took) == 1  # the probe; the others skipped at once
        assert sum(t < 0.2 for t in took) == threads - 1
        assert tier.stats().errors == 2 * threads
        os.kill(server.pid, signal.SIGCONT)
        stopped = False
        now[0] += 2.0  # the failed probe doubled the pause
        assert tier.contains_many([h]) == [True]
        tier.close()
    finally:
        if stopped:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def test_a_block_over_the_servers_proto_max_bulk_len_is_rejected_not_an_outage() -> None:
    """The server drops a connection that sends a value over `proto-max-bulk-len`; the tier
    must not send it (that would read as an outage and pause every call for the backoff)."""
    with ValkeyServer(ValkeyServerSpec()) as server:
        valkey.Valkey.from_url(server.url).config_set("proto-max-bulk-len", 1024 * KIB)
        tier = ValkeyTier(
            ValkeyTierSettings(url=server.url, backoff_initial_s=3600, backoff_max_s=3600),
            NAMESPACE,
        )
        h, meta, payload = make_block(12, 0, 1024 * KIB)  # with its header, over 1 MiB
        assert not tier.put(h, meta, payload).stored
        small = make_block(12, 1, 4 * KIB)
        assert tier.put(*small).stored  # not in a backoff
        assert tier.contains_many([h, small[0]]) == [False, True]
        stats = tier.stats()
        assert (stats.rejected, stats.errors, stats.stored) == (1, 0, 1)
        tier.close()


def test_corrupt_removed_counts_only_what_the_server_deleted(tmp_path: Path) -> None:
    """An ACL user that may not DEL (nor CONFIG): invalid values are misses left in place,
    counted as errors, not as removed; the size limit falls back to the default."""
    with ValkeyServer(ValkeyServerSpec()) as server:
        admin = valkey.Valkey.from_url(server.url)
        admin.execute_command(
            "ACL", "SETUSER", "nodel", "on", ">pw", "~*", "+@all", "-del", "-unlink", "-config"
        )
        (tmp_path / "password").write_text("pw\n")
        tier = ValkeyTier(
            ValkeyTierSettings(
                url=server.url, username="nodel", password_file=str(tmp_path / "password")
            ),
            NAMESPACE,
        )
        blocks = [make_block(13, i, 4 * KIB) for i in range(3)]
        assert tier.put(*blocks[0]).stored
        corrupt, hashed = tier.key(blocks[0][0]), tier.key(blocks[1][0])
        admin.setrange(corrupt, 4096 + 10, b"\xff\xfe")
        admin.hset(hashed, "field", "value")
        assert tier.get_many([blocks[0][0], blocks[1][0]]) == [None, None]
        assert admin.exists(corrupt, hashed) == 2  # DEL refused (NOPERM)
        stats = tier.stats()
        assert (stats.misses, stats.corrupt_removed, stats.errors) == (2, 0, 2)
        assert tier.put(*blocks[2]).stored and tier.stats().rejected == 0
        tier.close()


def test_a_single_shard_cluster_serves_batches_of_keys_in_different_hash_slots() -> None:
    """Block keys fall in different hash slots: a batch must not be one multi-key command,
    which a cluster-mode server refuses (CROSSSLOT) even when one shard holds every slot."""
    with ClusterNode(ValkeyServerSpec(port=cluster_port())) as server:
        admin = valkey.Valkey.from_url(server.url)
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        assert poll(lambda: b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"), 10)
        tier = tier_for(server)
        blocks = [make_block(14, i, 4 * KIB) for i in range(5)]
        for block in blocks[:3]:
            assert tier.put(*block).stored
        foreign = [tier.key(h) for h, _, _ in blocks[3:]]
        admin.hset(foreign[0], "field", "value")  # keys of another type: removed
        admin.rpush(foreign[1], "item")
        hashes = [h for h, _, _ in blocks]
        assert len({admin.execute_command("CLUSTER", "KEYSLOT", k) for k in foreign}) == 2
        got = tier.get_many(hashes)
        payloads = [bytes(b.payload) if b else None for b in got]
        assert payloads == [p for _, _, p in blocks[:3]] + [None, None]
        assert [admin.exists(k) for k in foreign] == [0, 0]
        stats = tier.stats()
        assert (stats.hits, stats.misses, stats.corrupt_removed, stats.errors) == (3, 2, 2, 0)
        tier.close()
