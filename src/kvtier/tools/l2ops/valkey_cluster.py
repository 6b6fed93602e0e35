"""Valkey clusters on loopback, for tests and `kvtier bench store --l2 valkey-cluster`:
cluster-mode servers whose hash slots are split between them, joined with CLUSTER MEET (what
`valkey-cli --cluster create` does, without replicas)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import valkey

from kvtier.core.errors import TierError
from kvtier.core.tiers.valkey_shards import SLOTS
from kvtier.net.ports import free_port_range
from kvtier.tools.l2ops.valkey_server import ValkeyServer, ValkeyServerSpec

BUS_OFFSET = 10000
"""A cluster node also listens on its port + this (the cluster bus)."""
FORM_TIMEOUT_S = 30.0
"""How long the nodes may take to agree that the cluster is whole."""


class ClusterNode(ValkeyServer):
    """A cluster-mode server (`cluster-enabled yes`; its slots and peers in `nodes.conf` of its
    data directory, so a restart on the same port rejoins the cluster)."""

    def command(self) -> list[str]:
        return [*super().command(), "--cluster-enabled", "yes", "--cluster-node-timeout", "1000"]


def cluster_port() -> int:
    """A free loopback port whose cluster-bus port is free too."""
    return free_port_range(2, step=BUS_OFFSET)


def cluster_ok(node: ValkeyServer, nodes: int) -> bool:
    """Whether `node` sees a healthy cluster of `nodes` nodes (every slot served)."""
    admin = valkey.Valkey.from_url(node.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        info = admin.execute_command("CLUSTER", "INFO").decode()  # type: ignore[no-untyped-call]
    except valkey.exceptions.ValkeyError:
        return False
    finally:
        admin.close()  # type: ignore[no-untyped-call]
    return "cluster_state:ok" in info and f"cluster_known_nodes:{nodes}" in info


@contextmanager
def valkey_cluster(
    shards: int = 3, spec: ValkeyServerSpec | None = None
) -> Iterator[list[ClusterNode]]:
    """`shards` nodes from `spec` (a free port each, and a directory of its own under its
    `data_dir`) holding equal ranges of the slots, each a primary without replicas; stopped
    (temporary data directories removed) on exit, also on failure."""
    base = spec or ValkeyServerSpec()
    with ExitStack() as stack:
        nodes = [
            stack.enter_context(
                ClusterNode(
                    replace(
                        base,
                        port=cluster_port(),
                        data_dir=base.data_dir and os.path.join(base.data_dir, f"node{i}"),
                    )
                )
            )
            for i in range(shards)
        ]
        step = SLOTS // shards
        for i, node in enumerate(nodes):
            admin = stack.enter_context(valkey.Valkey.from_url(node.url))
            last = SLOTS - 1 if i == shards - 1 else (i + 1) * step - 1
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
            if i:
                admin.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        deadline = time.monotonic() + FORM_TIMEOUT_S
        while not all(cluster_ok(n, shards) for n in nodes):
            if time.monotonic() > deadline:
                raise TierError(
                    f"{shards} Valkey nodes did not form a cluster in {FORM_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)
        yield nodes
