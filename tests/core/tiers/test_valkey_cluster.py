"""The Valkey L2 tier on a real three-shard Valkey cluster on loopback."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import valkey
from valkey.crc import key_slot

from kvtier.core.codec import BlockMeta
from kvtier.core.keys import BlockHash
from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings
from kvtier.core.tiers.valkey_shards import SLOTS
from kvtier.tools.l2ops.valkey_cluster import (
    ClusterNode,
    cluster_ok,
    cluster_port,
    valkey_cluster,
)
from kvtier.tools.l2ops.valkey_server import ValkeyServerSpec
from tests.helpers.l2 import IDENTITY, NAMESPACE, make_block, poll

pytestmark = pytest.mark.valkey

KIB = 1024
SHARDS = 3
Block = tuple[BlockHash, BlockMeta, bytes]


def tier_at(url: str) -> ValkeyTier:
    settings = ValkeyTierSettings(url=url, backoff_initial_s=0.05, backoff_max_s=0.2)
    return ValkeyTier(settings, NAMESPACE, IDENTITY.manifest())


def keys_on(node: ClusterNode) -> int:
    with valkey.Valkey.from_url(node.url) as admin:
        return int(admin.dbsize())


@contextmanager
def stored_on_a_cluster(seed: int) -> Iterator[tuple[list[ClusterNode], ValkeyTier, list[Block]]]:
    """A three-shard cluster, a tier on it (closed on exit) and 24 blocks it stored."""
    blocks = [make_block(seed, i, 4 * KIB) for i in range(24)]
    with valkey_cluster(SHARDS) as nodes:
        tier = tier_at(nodes[0].url)
        try:
            assert all(tier.put(*block).stored for block in blocks)
            yield nodes, tier, blocks
        finally:
            tier.close()


def test_blocks_spread_over_every_shard_and_another_replica_hits_them_in_one_batch() -> None:
    with stored_on_a_cluster(21) as (nodes, writer, blocks):
        hashes = [h for h, _, _ in blocks]
        on_shards = [keys_on(node) for node in nodes]
        assert all(on_shards) and sum(on_shards) == len(blocks) + 1  # and the manifest
        reader = tier_at(nodes[2].url)  # another replica, given another node's address
        assert reader.contains_many(hashes) == [True] * len(blocks)
        got = reader.get_many(hashes)
        assert [bytes(b.payload) if b else None for b in got] == [p for _, _, p in blocks]
        assert not writer.put(*blocks[0]).stored  # SET NX: published once
        stats, written = reader.stats(), writer.stats()
        assert (stats.hits, stats.misses, stats.errors) == (len(blocks), 0, 0)
        assert (written.stored, written.already_present, written.errors) == (len(blocks), 1, 0)
        reader.close()


def test_a_tier_made_before_the_cluster_answers_uses_its_shards_once_it_does() -> None:
    """The client is chosen at the first contact, not at construction: a replica that starts
    before its cluster must not stay on a single-server client (every key of other shards
    MOVED)."""
    port = cluster_port()
    tier = tier_at(f"redis://127.0.0.1:{port}")
    blocks = [make_block(22, i, 4 * KIB) for i in range(12)]
    assert tier.contains_many([h for h, _, _ in blocks]) == [False] * len(blocks)
    assert tier.stats().errors >= 1
    with valkey_cluster(SHARDS - 1) as others, ClusterNode(ValkeyServerSpec(port=port)) as node:
        with valkey.Valkey.from_url(node.url) as admin:
            admin.execute_command("CLUSTER", "MEET", "127.0.0.1", others[0].port)
        # the new node holds no slot: it answers every key with MOVED to the others
        assert poll(lambda: cluster_ok(node, SHARDS), 30)
        assert poll(lambda: tier.put(*blocks[0]).stored, 5)
        assert all(tier.put(*block).stored for block in blocks[1:])
        assert sum(keys_on(n) for n in others) == len(blocks) + 1
        assert [bool(b) for b in tier.get_many([h for h, _, _ in blocks])] == [True] * len(blocks)
        tier.close()


def test_a_dead_shard_turns_calls_into_counted_misses_without_delay_then_its_slots_return() -> None:
    with stored_on_a_cluster(23) as (nodes, tier, blocks):
        hashes = [h for h, _, _ in blocks]
        with valkey.Valkey.from_url(nodes[2].url) as admin:
            on_dead = {key.decode() for key in admin.keys(f"{NAMESPACE}:*")}
        lost = [tier.key(h) in on_dead for h in hashes]
        assert 0 < sum(lost) < len(blocks)
        nodes[2].kill()  # SIGKILL: its blocks are lost (no persistence), its slots unserved
        started = time.monotonic()
        for _ in range(20):  # calls in the outage and its backoff: misses, never a raise
            assert sum(tier.contains_many(hashes)) < len(blocks)
            assert sum(map(bool, tier.get_many(hashes))) < len(blocks)
        assert time.monotonic() - started < 20  # bounded by the timeouts, not stuck
        assert tier.stats().errors > 0
        nodes[2].start()  # the same port and nodes.conf: it takes its slots back, empty
        assert poll(lambda: all(cluster_ok(n, SHARDS) for n in nodes), 30)
        kept = [not gone for gone in lost]
        assert poll(lambda: tier.contains_many(hashes) == kept, 10)
        assert poll(lambda: tier.put(*blocks[lost.index(True)]).stored, 5)
        assert all(
            tier.put(*b).stored == gone
            for b, gone in zip(blocks, lost, strict=True)
            if b is not blocks[lost.index(True)]
        )
        assert tier.contains_many(hashes) == [True] * len(blocks)


def test_a_hung_shard_costs_a_call_one_timeout_and_no_call_raises() -> None:
    """A shard that stops answering (SIGSTOP) costs a batch one timeout, not one per key, and
    every call is a miss. (valkey-py's cluster client, used before, retried each key alone: a
    lookup took 8 s, and get_many raised a TypeError on the exceptions among its values.)"""
    with stored_on_a_cluster(24) as (nodes, _, blocks):
        hashes = [h for h, _, _ in blocks]
        settings = ValkeyTierSettings(
            url=nodes[0].url,
            socket_timeout_s=1.0,
            lookup_timeout_s=0.5,
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        tier = ValkeyTier(settings, NAMESPACE, IDENTITY.manifest())
        assert tier.contains_many(hashes) == [True] * len(blocks)
        assert nodes[2].pid is not None
        os.kill(nodes[2].pid, signal.SIGSTOP)
        try:
            for call, bound_s in ((tier.contains_many, 0.5), (tier.get_many, 1.0)):
                time.sleep(0.25)  # past the pause of the fault before
                started = time.monotonic()
                assert not any(call(hashes))
                assert time.monotonic() - started < bound_s + 1.0
        finally:
            os.kill(nodes[2].pid, signal.SIGCONT)
        assert tier.stats().errors >= 2
        assert poll(lambda: tier.contains_many(hashes) == [True] * len(blocks), 10)
        tier.close()


def test_a_cluster_that_refuses_queries_pauses_the_tier_with_one_warning_per_pause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CLUSTERDOWN (a shard is gone, its slots unserved) is an outage: calls are misses, the
    tier pauses and logs once per pause. (Before, each call logged a warning, each batch a
    false "reachable again", and each put slept 0.25 s in the cluster client.)"""
    with stored_on_a_cluster(25) as (nodes, tier, blocks):
        alive = 2 * (SLOTS // SHARDS)  # nodes 0 and 1 hold the slots below (valkey_cluster)
        hashes = [h for h, _, _ in blocks if key_slot(tier.key(h).encode()) < alive]
        fresh = [make_block(26, i, 4 * KIB) for i in range(200)]
        fresh = [b for b in fresh if key_slot(tier.key(b[0]).encode()) < alive][:50]
        nodes[2].kill()
        assert poll(lambda: not cluster_ok(nodes[0], SHARDS), 10)
        caplog.clear()
        started = time.monotonic()
        for block in fresh:  # asking only the shards still up: each answers CLUSTERDOWN
            assert not any(tier.contains_many(hashes))
            assert not tier.put(*block).stored
        elapsed = time.monotonic() - started
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert elapsed < 10
        assert 1 <= len(warnings) <= elapsed / 0.2 + 5, warnings
        assert all("cluster not usable now (CLUSTERDOWN" in w for w in warnings), warnings
        assert "reachable again" not in caplog.text


def test_a_cluster_url_naming_a_database_other_than_0_is_logged_as_such(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with valkey_cluster(SHARDS) as nodes:
        tier = tier_at(nodes[0].url + "/2")
        assert not tier.put(*make_block(27, 0, 4 * KIB)).stored
        assert tier.stats().errors >= 1
        assert "cluster not usable now (a cluster has database 0 only" in caplog.text
        tier.close()


def _shard_of(key: str) -> int:
    """Which of `valkey_cluster(SHARDS)`'s nodes holds `key` (equal slot ranges, in order)."""
    return min(key_slot(key.encode()) // (SLOTS // SHARDS), SHARDS - 1)


def _configure(nodes: list[ClusterNode], name: str, value: str) -> None:
    for node in nodes:
        with valkey.Valkey.from_url(node.url) as admin:
            admin.config_set(name, value)


def test_nodes_that_announce_no_address_are_reached_at_the_urls_host() -> None:
    """A cluster behind a load balancer announces no endpoint (CLUSTER SLOTS names no host, or
    "?"): the shards are reached at the URL's host, not at localhost:6379 or by a TypeError."""
    blocks = [make_block(28, i, 4 * KIB) for i in range(12)]
    with valkey_cluster(SHARDS) as nodes:
        for endpoint in ("unknown-endpoint", "hostname"):
            _configure(nodes, "cluster-preferred-endpoint-type", endpoint)
            tier = tier_at(nodes[1].url)
            for block in blocks:  # (stored by the first round, present in the second)
                tier.put(*block)
            assert tier.contains_many([h for h, _, _ in blocks]) == [True] * len(blocks)
            assert tier.stats().errors == 0
            tier.close()


def test_a_lookup_after_a_pause_waits_the_lookup_timeout_not_the_read_timeout() -> None:
    """The call that ends a pause reopens the clients; it must not wait out the reads' 10 s
    (the manifest was written again at each reopen, through the reads' clients)."""
    with stored_on_a_cluster(29) as (nodes, _, blocks):
        hashes = [h for h, _, _ in blocks]
        settings = ValkeyTierSettings(url=nodes[0].url, backoff_initial_s=0.05, backoff_max_s=0.2)
        tier = ValkeyTier(settings, NAMESPACE, IDENTITY.manifest())
        hung = nodes[_shard_of(f"{NAMESPACE}:manifest")]
        assert hung.pid is not None
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                time.sleep(0.25)  # past the pause
                started = time.monotonic()
                assert not all(tier.contains_many(hashes))
                assert time.monotonic() - started < 2 * settings.lookup_timeout_s + 0.5
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        tier.close()


def test_the_url_node_dead_the_tier_asks_the_other_nodes_for_the_slots() -> None:
    """The node the URL names dies (its slots unserved; the others serve theirs, coverage not
    required): the tier reopens from the other nodes the last map named, and hits the blocks
    on the shards that live. A node refusing CLUSTER SLOTS (ACLs are per node) is passed over,
    not taken for a single server at the dead URL."""
    with stored_on_a_cluster(30) as (nodes, tier, blocks):
        _configure(nodes, "cluster-require-full-coverage", "no")
        with valkey.Valkey.from_url(nodes[1].url) as admin:
            admin.execute_command("ACL", "SETUSER", "default", "-cluster|slots")
        hashes = [h for h, _, _ in blocks]
        alive = [_shard_of(tier.key(h)) != 0 for h in hashes]
        assert 0 < sum(alive) < len(hashes)
        nodes[0].kill()
        assert not all(tier.contains_many(hashes))  # a fault: the map is asked again
        kept = [h for h, up in zip(hashes, alive, strict=True) if up]
        assert poll(lambda: tier.contains_many(kept) == [True] * len(kept), 15)


def test_calls_from_many_threads_while_connections_break_never_raise() -> None:
    """Faults drop a cluster's clients while other threads use them and reopen them: no call
    may raise (a race once returned None from the reopen, a TypeError out of the tier)."""
    with stored_on_a_cluster(31) as (nodes, tier, blocks):
        hashes = [h for h, _, _ in blocks]
        errors: list[BaseException] = []
        stop = threading.Event()

        def lookups() -> None:
            while not stop.is_set():
                try:
                    tier.contains_many(hashes)
                    tier.get_many(hashes[:4])
                except BaseException as exc:  # what the test is about
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=lookups) for _ in range(8)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline and not errors:
                for node in nodes:
                    with valkey.Valkey.from_url(node.url) as admin:
                        admin.client_kill_filter(_type="normal", skipme=True)
                time.sleep(0.02)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
            sys.setswitchinterval(interval)
        assert errors == []
        assert poll(lambda: tier.contains_many(hashes) == [True] * len(hashes), 10)
