"""The replicas' L2 in Valkey: the in-cluster server (components/valkey) or an external one.

In the cluster (no `l2CacheLocalUrl`), `valkey_patch` sets the server's image, `maxmemory` (the
L2 size) and memory limit (`valkey_memory_gib`), and with l2CachePersistent an append-only file
on a claim of its own; `valkey_env` gives a named fleet's replicas the URL of its own Service
and the generated password. Outside it, `external_valkey_policy` lets the replicas reach the
server's port. Pure builders of dicts: the caller writes them into the overlay.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from kvtier.tools.cluster.spec import GIB, FleetSpec
from kvtier.tools.deploy.fleet_name import INSTANCE_LABEL, NAME_LABEL, object_name
from kvtier.tools.deploy.l2_volume import claim_spec
from kvtier.tools.l2ops.valkey_server import PERSISTENT_L2_APPENDFSYNC

__all__ = ["external_valkey_policy", "valkey_env", "valkey_memory_gib", "valkey_patch"]

VALKEY_OVERHEAD = 1.25
"""The in-cluster Valkey's resident memory per byte of data at `maxmemory` (the allocator's
fragmentation, per-key structures), plus `VALKEY_BASE_GIB` for the server itself."""
VALKEY_BASE_GIB = 0.5
VALKEY_DATA = "/data"
"""Where a persistent in-cluster Valkey keeps its append-only file (its claim's mount)."""


def valkey_memory_gib(spec: FleetSpec) -> int:
    """The in-cluster Valkey's memory (request = limit) in whole GiB: the data at `maxmemory`
    (the L2 size) as resident (`VALKEY_OVERHEAD`, `VALKEY_BASE_GIB`); with l2CachePersistent,
    room to copy all of it once more. An append-only-file rewrite forks: the child writing the
    new file shares the server's pages until the server writes them, so under steady writes
    and evictions every page may be copied before it ends (copy-on-write), and both copies
    count against the container's limit, which `maxmemory` does not see: without the room the
    kernel OOM-kills the server mid-rewrite."""
    data = spec.cache.l2.size_gib * VALKEY_OVERHEAD
    copied = data if spec.cache.l2.persistent else 0
    return math.ceil(data + copied + VALKEY_BASE_GIB)


def valkey_patch(spec: FleetSpec) -> dict[str, Any]:
    """Image and memory of the in-cluster Valkey (maxmemory = the L2 size; its limit:
    `valkey_memory_gib`); with l2CachePersistent, its append-only file on a claim of its own."""
    gib = spec.cache.l2.size_gib
    args = ["--requirepass", "$(VALKEY_PASSWORD)", "--maxmemory", str(int(gib * GIB))]
    args += ["--maxmemory-policy", "allkeys-lru", "--save", ""]
    memory = f"{valkey_memory_gib(spec)}Gi"
    container: dict[str, Any] = {
        "name": "valkey",
        "image": spec.kubernetes.valkey_image,
        "resources": {"requests": {"memory": memory}, "limits": {"memory": memory}},
    }
    statefulset: dict[str, Any] = {"template": {"spec": {"containers": [container]}}}
    if spec.cache.l2.persistent:
        args += ["--dir", VALKEY_DATA, "--appendonly", "yes"]
        args += ["--appendfsync", PERSISTENT_L2_APPENDFSYNC]
        container["volumeMounts"] = [{"name": "data", "mountPath": VALKEY_DATA}]
        container["startupProbe"] = _valkey_loaded_probe()
        statefulset["volumeClaimTemplates"] = [_valkey_claim(spec)]
    else:
        args += ["--appendonly", "no"]
    container["args"] = args
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "kvtier-valkey"},
        "spec": statefulset,
    }


def _valkey_claim(spec: FleetSpec) -> dict[str, Any]:
    """The persistent Valkey's own ReadWriteOnce claim: room for its append-only file, which
    grows to twice the data between rewrites and briefly holds a third copy during one."""
    return {
        "metadata": {"name": "data"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            **claim_spec(spec, spec.cache.l2.size_gib * 3 + 1),
        },
    }


def _valkey_loaded_probe() -> dict[str, Any]:
    """A startup probe: liveness waits while a restarted Valkey loads its append-only file (up
    to 10 minutes; PING answers LOADING until then)."""
    ping = 'valkey-cli --no-auth-warning -a "$VALKEY_PASSWORD" ping | grep -q PONG'
    return {
        "exec": {"command": ["sh", "-c", ping]},
        "periodSeconds": 5,
        "failureThreshold": 120,
    }


def external_valkey_policy(url: str, fleet: str | None) -> dict[str, Any]:
    """Replicas may reach the external Valkey's port (its address is outside the cluster)."""
    port = urlsplit(url).port or 6379
    replicas = {NAME_LABEL: "kvtier", "app.kubernetes.io/component": "replica"}
    if fleet is not None:
        replicas[INSTANCE_LABEL] = fleet
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "kvtier-replica-to-l2"},
        "spec": {
            "podSelector": {"matchLabels": replicas},
            "policyTypes": ["Egress"],
            "egress": [{"ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def valkey_env(spec: FleetSpec) -> list[dict[str, Any]]:
    """The in-cluster Valkey's URL naming the fleet's Service (components/valkey names the
    lone fleet's), after the password it expands: a patch's entries come first in the merged
    list, and `$(VAR)` expands only a variable defined above it."""
    host = object_name(spec, "kvtier-valkey")
    password = {"secretKeyRef": {"name": "kvtier-valkey", "key": "password"}}
    return [
        {"name": "VALKEY_PASSWORD", "valueFrom": password},
        {"name": "KVTIER_L2_URL", "value": f"redis://:$(VALKEY_PASSWORD)@{host}:6379/0"},
    ]
