"""`kvtier deploy render`: the overlay of a deployment file renders with kubectl, every object
validates, and what the file says is what the cluster would run."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvtier.cli import main
from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import parse_spec
from kvtier.tools.deploy import env as env_module
from kvtier.tools.deploy import render as render_module
from kvtier.tools.deploy.env import connector_env
from kvtier.tools.deploy.render import render
from kvtier.tools.monitoring import scrape_config
from kvtier.vllm.settings import ConnectorSettings
from tests.tools.deploy.kube import (
    assert_hardened,
    assert_pods_drain_in_grace,
    assert_rollouts_outlast_startup,
    by_kind,
    container,
    kustomize,
    validate,
)

FILES: dict[str, dict[str, Any]] = {
    "cpu-claim": {
        "replicas": 3,
        "kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "posix", "l2CacheSizeGiB": 4}},
        "kvtier": {
            "router": {"health_interval_s": 0.5, "drain_s": 120},
            "connector": {"admission": "reused"},
            "engineDtype": "float32",
            "replicaDrainSeconds": 300,
        },
        "kubernetes": {
            "device": "cpu",
            "namespace": "demo",
            "serviceMonitor": True,
            "serviceMonitorLabels": {"release": "prom"},
        },
    },
    "gpu-curvine": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "intelligentRoutingSpec": {"routingStrategy": "prefixaware"},
        "kubernetes": {
            "l2Volume": "curvine",
            "image": "registry.example/kvtier/vllm-gpu:1",
            "replicaResources": {"requests": {"cpu": "8", "nvidia.com/gpu": "2"}},
            "vllmArgs": ["--tensor-parallel-size", "2"],
        },
    },
    "gpu-juicefs": {
        "model": "/models/qwen",
        "kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "juicefs"}},
        "kubernetes": {"namespace": "team-a", "modelClaim": "weights", "modelMountPath": "/models"},
    },
    "existing-claim": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kubernetes": {"l2Volume": "existingClaim", "l2ClaimName": "efs-kv", "l2FileSystem": "efs"},
    },
    "existing-claim-model-claim": {
        "model": "/models/qwen",
        "kubernetes": {
            "l2Volume": "existingClaim",
            "l2ClaimName": "efs-kv",
            "modelClaim": "weights",
            "modelMountPath": "/models",
        },
    },
    "gpu-resources": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kubernetes": {"replicaResources": {"requests": {"cpu": "6", "memory": "30Gi"}}},
    },
    "one-router": {"model": "Qwen/Qwen2-7B-Instruct", "replicas": 1, "kubernetes": {"routers": 1}},
    "gated": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "kubernetes": {
            "replicaEnv": {"HF_TOKEN": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            "routerEnv": {
                "HF_TOKEN": {"secretKeyRef": {"name": "hf", "key": "token"}},
                "HF_HUB_ETAG_TIMEOUT": "30",
            },
        },
    },
    "big-l1": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kvCacheSpec": {"l1CacheSizeGiB": 64},
        "kubernetes": {"modelCacheGiB": 80},
    },
    "scheduled": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "valkey", "l2CacheSizeGiB": 2}},
        "kubernetes": {
            "replicaTolerations": [
                {"key": "dedicated", "value": "inference", "effect": "NoSchedule"},
                {
                    "key": "spot",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 60,
                },
            ],
            "routerTolerations": [{"operator": "Exists"}],
            "routerNodeSelector": {"pool": "system"},
            "replicaAffinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
                        ]
                    }
                }
            },
            "replicaPriorityClassName": "inference-high",
            "routerPriorityClassName": "system-cluster-critical",
            "replicaPodAnnotations": {"karpenter.sh/do-not-disrupt": "true"},
            "replicaPodLabels": {"team": "ml"},
            "routerPodLabels": {"example.com/tier": "edge"},
            "imagePullSecrets": ["registry", "mirror"],
        },
    },
    "valkey-inside": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "valkey", "l2CacheSizeGiB": 2}},
    },
    "valkey-persistent": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kvCacheSpec": {
            "l2CacheSpec": {
                "l2CacheBackend": "valkey",
                "l2CacheSizeGiB": 2,
                "l2CachePersistent": True,
            }
        },
        "kubernetes": {"l2StorageClass": "gp3"},
    },
    "valkey-outside": {
        "model": "Qwen/Qwen2-7B-Instruct",
        "kvCacheSpec": {
            "l2CacheSpec": {"l2CacheBackend": "redis", "l2CacheLocalUrl": "redis://cache:6380/1"}
        },
    },
    "no-l2": {"kubernetes": {"device": "cpu"}, "kvCacheSpec": {"enableL2Cache": False}},
    "no-cache": {
        "kubernetes": {"device": "cpu"},
        "intelligentRoutingSpec": {"enabled": False},
        "kvCacheSpec": {"enableL1Cache": False, "enableL2Cache": False},
    },
    # the shipped components these use generate ConfigMaps of their own (defaults)
    "valkey-l1": {
        "model": "meta/llama",
        "kvCacheSpec": {"l1CacheSizeGiB": 8, "l2CacheSpec": {"l2CacheBackend": "valkey"}},
        "kvtier": {"connector": {"admission": "reused", "l2_file_mode": "0o640"}},
    },
    "cpu-model": {
        "model": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "kvCacheSpec": {"l1CacheSizeGiB": 4},
        "kubernetes": {"device": "cpu"},
    },
    "curvine-local": {
        "model": "meta/llama",
        "kubernetes": {"l2Volume": "curvine", "l2FileSystem": "local"},
    },
    "juicefs-nfs": {
        "model": "meta/llama",
        "kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "juicefs"}},
        "kubernetes": {"l2FileSystem": "nfs"},
        "kvtier": {"connector": {"l2_file_mode": "0o640"}, "router": {"drain_s": "45"}},
    },
}


def rendered(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    out = tmp_path / name
    render(parse_spec(FILES[name]), out)
    objects = kustomize(out)
    for obj in objects:
        validate(obj)
    return objects


def config_map(objects: list[dict[str, Any]], prefix: str) -> dict[str, str]:
    """The data of the one ConfigMap whose name starts with `prefix`."""
    (found,) = (
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(prefix)
    )
    data: dict[str, str] = found.get("data", {})
    return data


def env_of(objects: list[dict[str, Any]]) -> dict[str, str]:
    return config_map(objects, "kvtier-connector")


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_rendered_object_validates(tmp_path: Path, name: str) -> None:
    objects = rendered(tmp_path, name)
    spec = parse_spec(FILES[name])
    assert by_kind(objects, "Deployment", "kvtier-replica")["spec"]["replicas"] == spec.replicas
    namespace = spec.kubernetes.namespace
    assert all(o["metadata"].get("namespace", namespace) == namespace for o in objects)
    # what the replicas will parse is what the file says
    assert env_of(objects) == connector_env(spec)
    ConnectorSettings.from_sources({}, env_of(objects))
    assert assert_pods_drain_in_grace(objects) == (spec.local.replica_drain_s, spec.router_drain_s)
    assert_rollouts_outlast_startup(objects)
    assert_hardened(objects)


def test_cpu_fleet(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "cpu-claim")
    replica = container(objects, "kvtier-replica")
    assert replica["image"] == "kvtier/vllm-cpu:0.2.0"
    assert "nvidia.com/gpu" not in replica["resources"].get("limits", {})
    assert "--health-interval-s" in container(objects, "kvtier-router")["args"]
    args = replica["args"]
    assert args[args.index("--dtype") + 1] == "float32"
    assert args[args.index("--shutdown-timeout") + 1] == "300"
    pod = by_kind(objects, "Deployment", "kvtier-replica")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 20 + 300 + 40
    router = by_kind(objects, "Deployment", "kvtier-router")["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] == 10 + 120 + 10
    env = env_of(objects)
    assert env["KVTIER_ADMISSION"] == "reused"
    assert env["KVTIER_L2_CAPACITY_BYTES"] == str(4 * 1024**3)
    claim = by_kind(objects, "PersistentVolumeClaim", "kvtier-l2")
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert by_kind(objects, "ServiceMonitor", "kvtier")
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert "kvtier-model-download" not in names  # the embedded model is in the image


def test_gpu_curvine_fleet(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "gpu-curvine")
    replica = container(objects, "kvtier-replica")
    assert replica["image"] == "registry.example/kvtier/vllm-gpu:1"
    assert replica["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": "2", "ephemeral-storage": "32Gi"},
        "limits": {"nvidia.com/gpu": "2"},  # Kubernetes takes an extended resource as a limit
    }
    assert replica["args"][-2:] == ["--tensor-parallel-size", "2"]
    assert by_kind(objects, "PersistentVolumeClaim", "kvtier-l2")["spec"]["storageClassName"] == (
        "kvtier-curvine"
    )
    assert by_kind(objects, "StorageClass", "kvtier-curvine")["provisioner"] == "curvine"
    assert env_of(objects)["KVTIER_L2_PROFILE"] == "curvine"
    router = container(objects, "kvtier-router")
    assert router["args"][:2] == ["--strategy", "prefixaware"]
    assert by_kind(objects, "NetworkPolicy", "kvtier-model-download")  # an HF id: downloaded


def test_juicefs_fleet_mounts_the_model_claim(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "gpu-juicefs")
    storage_class = by_kind(objects, "StorageClass", "kvtier-juicefs")
    assert storage_class["parameters"]["csi.storage.k8s.io/node-publish-secret-namespace"] == (
        "team-a"
    )
    assert env_of(objects)["KVTIER_L2_PROFILE"] == "juicefs"
    for deployment in ("kvtier-replica", "kvtier-router"):
        pod = by_kind(objects, "Deployment", deployment)["spec"]["template"]["spec"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}} in pod[
            "volumes"
        ]
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert "kvtier-model-download" not in names  # a path: nothing to download


def test_existing_claim(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "existing-claim")
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    pod = by_kind(objects, "Deployment", "kvtier-replica")["spec"]["template"]["spec"]
    (l2,) = [v for v in pod["volumes"] if v["name"] == "l2"]
    assert l2 == {"name": "l2", "persistentVolumeClaim": {"claimName": "efs-kv"}}
    assert env_of(objects)["KVTIER_L2_PROFILE"] == "efs"


def test_an_existing_claim_and_a_model_claim_each_mount_their_own(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "existing-claim-model-claim")
    pod = by_kind(objects, "Deployment", "kvtier-replica")["spec"]["template"]["spec"]
    claims = {
        v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]
    }
    assert claims == {"l2": "efs-kv", "model": "weights", "dshm": None}


def test_gpu_replica_resources_keep_their_gpu_as_a_limit(tmp_path: Path) -> None:
    replica = container(rendered(tmp_path, "gpu-resources"), "kvtier-replica")
    assert replica["resources"] == {
        "requests": {"cpu": "6", "memory": "30Gi", "ephemeral-storage": "32Gi"},
        "limits": {"nvidia.com/gpu": "1"},  # the default GPU, where the API server needs it
    }
    unequal = {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "1"}}
    with pytest.raises(ConfigError, match=r"kubernetes\.replicaResources.*nvidia\.com/gpu"):
        parse_spec({"kubernetes": {"replicaResources": unequal}})


@pytest.mark.parametrize(
    ("name", "offline"),
    [("gpu-curvine", "0"), ("cpu-model", "0"), ("gpu-juicefs", "1"), ("cpu-claim", "1")],
)
def test_routers_and_replicas_reach_the_hub_when_the_model_is_downloaded(
    tmp_path: Path, name: str, offline: str
) -> None:
    """An HF id: the pods may reach the hub (the CPU image, the default router image, and the
    cpu component would otherwise keep them offline); a path: offline, as the network is."""
    objects = rendered(tmp_path, name)
    for deployment in ("kvtier-replica", "kvtier-router"):
        env = {e["name"]: e.get("value") for e in container(objects, deployment)["env"]}
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == offline, deployment


def test_router_and_replica_environment_with_a_secret(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "gated")
    token = {"valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    for deployment in ("kvtier-replica", "kvtier-router"):
        env = {e["name"]: e for e in container(objects, deployment)["env"]}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", **token}
        assert env["HF_HUB_OFFLINE"]["value"] == "0"
    router = {e["name"]: e for e in container(objects, "kvtier-router")["env"]}
    assert router["HF_HUB_ETAG_TIMEOUT"] == {"name": "HF_HUB_ETAG_TIMEOUT", "value": "30"}
    assert "KVTIER_TENANT_SALT_KEY" in router  # the base's, kept
    with pytest.raises(ConfigError, match=r"kubernetes\.routerEnv\.HF_TOKEN.*key: required"):
        parse_spec({"kubernetes": {"routerEnv": {"HF_TOKEN": {"secretKeyRef": {"name": "hf"}}}}})


def test_disruption_budgets_let_a_drain_evict_a_lone_or_unready_pod(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "one-router")
    for name in ("kvtier-replica", "kvtier-router"):
        pods = by_kind(objects, "Deployment", name)["spec"]["replicas"]
        budget = by_kind(objects, "PodDisruptionBudget", name)["spec"]
        allowed = budget.get("maxUnavailable", pods - budget.get("minAvailable", 0))
        assert pods == 1 and allowed >= 1, name
        assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # routers, no replica up


def relabel(target: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus' relabeling of a target's labels by `replace` rules; the labels kept."""
    labels = dict(target)
    for rule in rules:
        assert rule.get("action", "replace") == "replace", rule
        value = rule.get("separator", ";").join(labels.get(n, "") for n in rule["sourceLabels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1"))
            labels[rule["targetLabel"]] = match.expand(replacement)
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def test_the_service_monitor_labels_targets_as_kvtier_up_monitor_does(tmp_path: Path) -> None:
    """The same `job` and `replica` labels as the local Prometheus (kvtier.tools.monitoring),
    which deploy/prometheus' rules and alerts and the Grafana dashboard select and group by."""
    monitor = by_kind(rendered(tmp_path, "cpu-claim"), "ServiceMonitor", "kvtier")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    # pods as the router names them (kvtier.router.discovery): http://ADDRESS:PORT, [IPv6]
    router, replicas = "http://10.0.0.9:8000", ["http://10.0.0.7:8000", "http://[fd00::7]:8000"]
    local = scrape_config(router, replicas, interval_s=15, rules=[])["scrape_configs"]
    expected = {
        target: {"job": job["job_name"], **group.get("labels", {})}
        for job in local
        for group in job["static_configs"]
        for target in group["targets"]
    }
    services = [("kvtier-router", "router", router)]
    services += [("kvtier-replicas", "replica", url) for url in replicas]
    for service, component, url in services:
        address = urlsplit(url).netloc  # as Prometheus writes __address__ ([IPv6]:port)
        target = {  # as prometheus-operator gives it to the endpoint's relabelings
            "__address__": address,
            "__meta_kubernetes_service_name": service,
            "__meta_kubernetes_service_label_app_kubernetes_io_component": component,
            "job": service,
        }
        assert relabel(target, endpoint["relabelings"]) == expected[address], url


def test_valkey_inside_gets_a_password_and_its_size(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "valkey-inside")
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    valkey = by_kind(objects, "StatefulSet", "kvtier-valkey")["spec"]["template"]["spec"]
    args = valkey["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == str(2 * 1024**3)
    secret = next(o for o in objects if o["metadata"]["name"].startswith("kvtier-valkey-"))
    assert secret["kind"] == "Secret" and "password" in secret["data"]
    replica = container(objects, "kvtier-replica")
    env = {e["name"]: e for e in replica["env"]}
    assert env["VALKEY_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert env["KVTIER_L2_URL"]["value"] == "redis://:$(VALKEY_PASSWORD)@kvtier-valkey:6379/0"
    assert "KVTIER_L2_PATH" not in env_of(objects)
    assert not [m for m in replica.get("volumeMounts", []) if m["name"] == "l2"]


def test_a_persistent_valkey_keeps_its_append_only_file_on_a_claim_of_its_own(
    tmp_path: Path,
) -> None:
    ephemeral = by_kind(rendered(tmp_path, "valkey-inside"), "StatefulSet", "kvtier-valkey")
    assert "volumeClaimTemplates" not in ephemeral["spec"]
    args = ephemeral["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "no"

    objects = rendered(tmp_path, "valkey-persistent")
    valkey = by_kind(objects, "StatefulSet", "kvtier-valkey")["spec"]
    (claim,) = valkey["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "7Gi"  # 3 x 2 GiB + 1
    assert claim["spec"]["storageClassName"] == "gp3"
    server = valkey["template"]["spec"]["containers"][0]
    args = server["args"]
    assert args[args.index("--dir") + 1] == "/data"
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--maxmemory") + 1] == str(2 * 1024**3)
    assert server["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    probe = server["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600  # loading the file
    assert "readinessProbe" in server and "livenessProbe" in server  # the base's, kept
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]  # no shared L2 claim


@pytest.mark.parametrize("size_gib", [2, 64])
def test_a_persistent_valkey_has_room_to_rewrite_its_append_only_file(
    tmp_path: Path, size_gib: int
) -> None:
    """A rewrite of the append-only file forks; under writes the server's pages are copied
    (copy-on-write) until the child ends, up to all of them: the limit holds the server at
    maxmemory (its data x1.25 for fragmentation, + 0.5 GiB) and a copy of its data. Without
    persistence nothing forks."""
    for persistent in (False, True):
        l2 = {"l2CacheBackend": "valkey", "l2CacheSizeGiB": size_gib}
        file = {"model": "meta/llama", "kvCacheSpec": {"l2CacheSpec": l2}}
        l2["l2CachePersistent"] = persistent
        render(parse_spec(file), tmp_path / str(persistent))
        objects = kustomize(tmp_path / str(persistent))
        valkey = by_kind(objects, "StatefulSet", "kvtier-valkey")
        server = valkey["spec"]["template"]["spec"]["containers"][0]
        maxmemory = int(server["args"][server["args"].index("--maxmemory") + 1])
        assert maxmemory == size_gib * 1024**3
        resources = server["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
        limit = resources["limits"]["memory"]
        assert limit.endswith("Gi")
        needed = 1.25 * maxmemory + 0.5 * 1024**3 + (1.25 * maxmemory if persistent else 0)
        assert needed <= int(limit.removesuffix("Gi")) * 1024**3 < needed + 1024**3, limit


def test_valkey_outside(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "valkey-outside")
    assert env_of(objects)["KVTIER_L2_URL"] == "redis://cache:6380/1"
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    policy = by_kind(objects, "NetworkPolicy", "kvtier-replica-to-l2")
    assert policy["spec"]["egress"] == [{"ports": [{"protocol": "TCP", "port": 6380}]}]


def test_no_cache_at_all(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "no-cache")
    replica = container(objects, "kvtier-replica")
    assert "--kv-transfer-config" not in replica["args"]
    router = container(objects, "kvtier-router")["args"]
    assert router[:2] == ["--strategy", "roundrobin"] and "--replica-events-port" not in router
    assert env_of(objects) == {}


@pytest.mark.parametrize(
    ("name", "connector", "model"),
    [
        (
            "valkey-l1",
            {"KVTIER_L1_BYTES": str(8 * 1024**3), "KVTIER_ADMISSION": "reused"},
            {"MODEL": "meta/llama"},
        ),
        (
            "cpu-model",
            {"KVTIER_L1_BYTES": str(4 * 1024**3)},
            {"MODEL": "HuggingFaceTB/SmolLM2-360M-Instruct"},
        ),
        ("curvine-local", {"KVTIER_L2_PROFILE": "local"}, {"SERVED_MODEL_NAME": "llama"}),
        ("juicefs-nfs", {"KVTIER_L2_PROFILE": "nfs"}, {"MODEL": "meta/llama"}),
    ],
)
def test_the_config_maps_hold_the_files_settings_over_the_components_defaults(
    tmp_path: Path, name: str, connector: dict[str, str], model: dict[str, str]
) -> None:
    objects = rendered(tmp_path, name)
    assert env_of(objects).items() >= connector.items()
    assert config_map(objects, "kvtier-model").items() >= model.items()


@pytest.mark.parametrize("name", ["valkey-l1", "juicefs-nfs"])
def test_a_file_mode_reaches_the_replicas_as_set(tmp_path: Path, name: str) -> None:
    env = env_of(rendered(tmp_path, name))
    assert ConnectorSettings.from_sources({}, env).l2_file_mode == 0o640


def test_render_refuses_settings_the_replicas_would_read_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def decimal(name: str, value: object) -> str:
        return str(int(str(value), 8)) if name == "l2_file_mode" else str(value)

    monkeypatch.setattr(env_module, "_env_value", decimal)
    with pytest.raises(ConfigError, match="l2_file_mode would not reach the replicas"):
        connector_env(parse_spec(FILES["juicefs-nfs"]))


def test_a_quoted_router_drain_is_a_number(tmp_path: Path) -> None:
    spec = parse_spec(FILES["juicefs-nfs"])
    assert spec.router_drain_s == 45
    pod = by_kind(rendered(tmp_path, "juicefs-nfs"), "Deployment", "kvtier-router")
    assert pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 10 + 45 + 10


def test_render_keeps_out_of_a_directory_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "repo"
    (mine / "base").mkdir(parents=True)
    (mine / "kustomization.yaml").write_text("resources: [base]\n")
    (mine / "base" / "app.yaml").write_text("kind: ConfigMap\n")
    spec = parse_spec(FILES["cpu-model"])
    with pytest.raises(ConfigError, match=f"--out {mine}: a non-empty directory"):
        render(spec, mine)
    assert (mine / "kustomization.yaml").read_text() == "resources: [base]\n"
    assert sorted(p.name for p in mine.rglob("*")) == ["app.yaml", "base", "kustomization.yaml"]
    with pytest.raises(ConfigError, match="not a directory"):
        render(spec, mine / "kustomization.yaml")
    (tmp_path / "empty").mkdir()
    render(spec, tmp_path / "empty")
    render(spec, tmp_path / "empty")  # its own: re-rendered


def test_a_render_that_fails_leaves_the_earlier_overlay_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "fleet"
    spec = parse_spec(FILES["valkey-inside"])
    render(spec, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(render_module, "_write", full)
    with pytest.raises(ConfigError, match=f"--out {out}: No space left on device"):
        render(spec.replaced(replicas=4), out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_render_that_fails_leaves_a_new_out_as_it_found_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A render that fails once it has made the secrets leaves neither them nor --out behind
    (a later render would refuse a non-empty directory it did not write), and adds none to an
    earlier render's."""
    spec = parse_spec(FILES["valkey-inside"])
    write = render_module._write

    def full(path: Path, doc: dict[str, Any]) -> None:
        if path.parent.name == "patches":  # written after the secrets
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write(path, doc)

    new, empty, earlier = tmp_path / "new", tmp_path / "empty", tmp_path / "earlier"
    empty.mkdir()
    render(parse_spec(FILES["one-router"]), earlier)
    monkeypatch.setattr(render_module, "_write", full)
    for out in (new, empty, earlier):
        with pytest.raises(ConfigError, match=f"--out {out}: No space left on device"):
            render(spec, out)
    assert not new.exists() and not list(empty.iterdir())
    assert sorted(p.name for p in (earlier / "secrets").iterdir()) == [
        "router-api-keys",
        "tenant-salt-key",
    ]
    monkeypatch.undo()
    for out in (new, empty, earlier):
        render(spec, out)
        assert (out / "secrets" / "valkey-password").stat().st_mode & 0o077 == 0


def test_an_out_that_cannot_be_made_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    spec = parse_spec(FILES["cpu-model"])
    with pytest.raises(ConfigError, match=f"--out {tmp_path}/file/x: Not a directory"):
        render(spec, tmp_path / "file" / "x")
    with pytest.raises(ConfigError, match="--out /proc/x: No such file or directory"):
        render(spec, Path("/proc/x"))


def test_rerender_keeps_the_secrets(tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    spec = parse_spec(FILES["valkey-inside"])
    render(spec, out)
    first = {p.name: p.read_text() for p in (out / "secrets").iterdir()}
    assert (out / "secrets" / "router-api-keys").stat().st_mode & 0o077 == 0
    render(spec.replaced(replicas=4), out)
    assert {p.name: p.read_text() for p in (out / "secrets").iterdir()} == first
    assert by_kind(kustomize(out), "Deployment", "kvtier-replica")["spec"]["replicas"] == 4


def test_gpu_needs_a_model(tmp_path: Path) -> None:
    assert connector_env(parse_spec({}))  # the connector needs none
    with pytest.raises(ConfigError, match="model: required for GPU replicas"):
        render(parse_spec({}), tmp_path / "out")


def test_kubernetes_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"kubernetes\.l2Volum: unknown setting"):
        parse_spec({"kubernetes": {"l2Volum": "curvine"}})
    with pytest.raises(ConfigError, match="kubernetes.l2ClaimName"):
        parse_spec({"kubernetes": {"l2Volume": "existingClaim"}})
    with pytest.raises(ConfigError, match="kubernetes.replicaResources.requests.cpu"):
        parse_spec({"kubernetes": {"replicaResources": {"requests": {"cpu": "lots"}}}})


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump(FILES["cpu-claim"]))
    assert main(["deploy", "render", "--config", str(config), "--out", str(tmp_path / "o")]) == 0
    assert "kubectl apply -k" in capsys.readouterr().out
    config.write_text("kubernetes: {devise: cpu}\n")
    assert main(["deploy", "render", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    assert "kubernetes.devise: unknown setting" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "memory"),
    [("big-l1", "92Gi"), ("one-router", "30Gi"), ("cpu-model", "9Gi"), ("no-cache", "5Gi")],
)
def test_replica_memory_holds_the_l1_and_the_shared_memory(
    tmp_path: Path, name: str, memory: str
) -> None:
    """vLLM's own (26Gi on GPU, 2Gi on CPU) + L1 + the memory-backed /dev/shm (2Gi) + on CPU
    the engine's KV cache: a 64 GiB L1 in a 30Gi limit is an OOM kill once warm."""
    replica = container(rendered(tmp_path, name), "kvtier-replica")
    assert replica["resources"]["requests"]["memory"] == memory
    assert replica["resources"]["limits"]["memory"] == memory


def test_a_replica_memory_limit_below_the_l1_is_refused(tmp_path: Path) -> None:
    small = {"requests": {"memory": "16Gi"}, "limits": {"memory": "70Gi"}}
    file = {**FILES["big-l1"], "kubernetes": {"replicaResources": small}}
    with pytest.raises(
        ConfigError,
        match=r"kubernetes\.replicaResources\.limits\.memory: 70Gi is below "
        r"kvCacheSpec\.l1CacheSizeGiB \(64\) \+ /dev/shm \(2\) \+ 8 for vLLM = 74Gi",
    ):
        render(parse_spec(file), tmp_path / "out")
    cpu = {**FILES["cpu-model"], "kubernetes": {"device": "cpu", "replicaResources": small}}
    cpu["kubernetes"]["replicaResources"] = {"limits": {"memory": "7800Mi"}}
    with pytest.raises(ConfigError, match=r"engineKvCacheGiB \(1\) \+ 1 for vLLM = 8Gi"):
        render(parse_spec(cpu), tmp_path / "cpu")
    cpu["kubernetes"]["replicaResources"] = {"limits": {"memory": "8Gi"}}
    render(parse_spec(cpu), tmp_path / "cpu")


def test_a_downloaded_model_is_cached_on_a_volume_of_its_size(tmp_path: Path) -> None:
    """An HF id downloads into an emptyDir at HF_HOME (kept across container restarts), the
    size the pod asks of the node's ephemeral storage; a path needs none."""
    objects = rendered(tmp_path, "big-l1")
    pod = by_kind(objects, "Deployment", "kvtier-replica")["spec"]["template"]["spec"]
    replica = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in replica["env"]}
    (mount,) = [m for m in replica["volumeMounts"] if m["name"] == "model-cache"]
    assert mount["mountPath"] == env["HF_HOME"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["emptyDir"] == {"sizeLimit": "80Gi"}
    assert replica["resources"]["requests"]["ephemeral-storage"] == "80Gi"
    for name in ("gpu-juicefs", "cpu-claim"):
        replica = container(rendered(tmp_path, name), "kvtier-replica")
        assert "ephemeral-storage" not in replica["resources"]["requests"]
        assert "HF_HOME" not in {e["name"] for e in replica["env"]}


def pod_spec(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(objects, kind, name)["spec"]["template"]["spec"]
    return spec


def test_scheduling_on_tainted_nodes_and_private_registries(tmp_path: Path) -> None:
    objects = rendered(tmp_path, "scheduled")
    replica = pod_spec(objects, "Deployment", "kvtier-replica")
    router = pod_spec(objects, "Deployment", "kvtier-router")
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert replica["tolerations"] == [
        gpu,
        {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    assert router["tolerations"] == [{"operator": "Exists"}]
    assert router["nodeSelector"] == {"pool": "system"} and "nodeSelector" not in replica
    assert list(replica["affinity"]) == ["nodeAffinity"] and "affinity" not in router
    assert replica["priorityClassName"] == "inference-high"
    assert router["priorityClassName"] == "system-cluster-critical"
    valkey = pod_spec(objects, "StatefulSet", "kvtier-valkey")
    for pod in (replica, router, valkey):
        assert pod["imagePullSecrets"] == [{"name": "registry"}, {"name": "mirror"}]
    metadata = by_kind(objects, "Deployment", "kvtier-replica")["spec"]["template"]["metadata"]
    assert metadata["annotations"] == {"karpenter.sh/do-not-disrupt": "true"}
    assert metadata["labels"]["team"] == "ml"
    assert metadata["labels"]["app.kubernetes.io/component"] == "replica"  # kept
    metadata = by_kind(objects, "Deployment", "kvtier-router")["spec"]["template"]["metadata"]
    assert metadata["labels"]["example.com/tier"] == "edge" and "annotations" not in metadata
    # GPU replicas tolerate the GPU taint by default; CPU ones stay off GPU nodes
    assert pod_spec(rendered(tmp_path, "gpu-curvine"), "Deployment", "kvtier-replica")[
        "tolerations"
    ] == [gpu]
    cpu = pod_spec(rendered(tmp_path, "cpu-claim"), "Deployment", "kvtier-replica")
    assert not cpu.get("tolerations")


@pytest.mark.parametrize(
    ("kubernetes", "error"),
    [
        (
            {"replicaTolerations": [{"key": "a", "effect": "Never"}]},
            r"replicaTolerations\.0\.effect",
        ),
        ({"routerTolerations": [{"value": "x"}]}, r"routerTolerations\.0\.key: required"),
        (
            {"replicaTolerations": [{"operator": "Exists", "value": "x"}]},
            r"replicaTolerations\.0\.value: none",
        ),
        (
            {"replicaTolerations": [{"key": "a", "tolerationSeconds": 5}]},
            r"replicaTolerations\.0\.tolerationSeconds",
        ),
        ({"routerAffinity": {"nodeAfinity": {}}}, r"routerAffinity\.nodeAfinity: unknown"),
        ({"replicaPriorityClassName": "High"}, "replicaPriorityClassName"),
        ({"imagePullSecrets": ["my_registry"]}, r"imagePullSecrets\.0"),
        ({"replicaPodLabels": {"team": "a b"}}, r"replicaPodLabels\.team"),
        ({"routerPodLabels": {"app.kubernetes.io/name": "x"}}, "routerPodLabels: app.kuber"),
        ({"replicaPodAnnotations": {"bad key": "x"}}, r"replicaPodAnnotations\.bad key"),
        (
            {"replicaPodAnnotations": {"karpenter.sh/do-not-disrupt": True}},
            r"replicaPodAnnotations\.karpenter\.sh/do-not-disrupt: input should be a valid string",
        ),
    ],
)
def test_bad_scheduling_settings_are_refused_naming_the_key(
    kubernetes: dict[str, Any], error: str
) -> None:
    with pytest.raises(ConfigError, match=rf"kubernetes[.:] ?{error}"):
        parse_spec({"kubernetes": kubernetes})


def test_the_routers_follow_vllms_own_kv_events_on_the_port_the_replicas_publish_them(
    tmp_path: Path,
) -> None:
    """kvaware: each replica publishes its engine's KV events (L0) on its `vllm-events` port,
    every router subscribes there on each pod it discovers, and the policies let it."""
    objects = rendered(tmp_path, "one-router")
    replica, router = container(objects, "kvtier-replica"), container(objects, "kvtier-router")
    config = json.loads(replica["args"][replica["args"].index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
    port = int(config["endpoint"].rpartition(":")[2])
    assert config["endpoint"] == f"tcp://*:{port}"  # every address of the pod
    assert {p["name"]: p["containerPort"] for p in replica["ports"]}["vllm-events"] == port
    replay = int(config["replay_endpoint"].rpartition(":")[2])  # what a router missed
    assert config["replay_endpoint"] == f"tcp://*:{replay}" and replay != port
    assert {p["name"]: p["containerPort"] for p in replica["ports"]}["vllm-replay"] == replay
    args = router["args"]
    assert args[args.index("--replica-vllm-events-port") + 1] == str(port)
    assert args[args.index("--replica-vllm-replay-port") + 1] == str(replay)
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    for p in (port, replay):
        assert {"protocol": "TCP", "port": p} in policies["kvtier-replica"]["ingress"][0]["ports"]
        assert {"protocol": "TCP", "port": p} in policies["kvtier-router"]["egress"][0]["ports"]

    # off by the setting, or for a strategy that reads no events
    for name, change in (
        ("off", {"kubernetes": {"vllmKvEvents": False}}),
        ("prefixaware", {"intelligentRoutingSpec": {"routingStrategy": "prefixaware"}}),
    ):
        render(parse_spec({**FILES["one-router"], **change}), tmp_path / name)
        objects = kustomize(tmp_path / name)
        assert "--kv-events-config" not in container(objects, "kvtier-replica")["args"]
        router_args = container(objects, "kvtier-router")["args"]
        assert "--replica-vllm-events-port" not in router_args
        assert "--replica-vllm-replay-port" not in router_args
    # a --kv-events-config of the user's would replace the one the routers follow
    own: dict[str, Any] = {"kubernetes": {"vllmArgs": ["--kv-events-config={}"]}}
    with pytest.raises(ConfigError, match=r"kubernetes\.vllmArgs: --kv-events-config is set by"):
        render(parse_spec({**FILES["one-router"], **own}), tmp_path / "own")
    own["kubernetes"]["vllmKvEvents"] = False
    render(parse_spec({**FILES["one-router"], **own}), tmp_path / "own")


TUNABLE_ENV = {
    "HF_HUB_OFFLINE",  # a hub mirror inside the cluster (docs/kubernetes.md)
    "TRANSFORMERS_OFFLINE",
    "VLLM_CPU_OMP_THREADS_BIND",  # the cpu component's fixed choices
    "VLLM_CPU_CI_ENV",
    "VLLM_NO_USAGE_STATS",
}


@pytest.mark.parametrize("name", ["cpu-claim", "valkey-inside", "big-l1", "gpu-juicefs"])
def test_replica_env_may_not_override_what_the_overlay_sets(tmp_path: Path, name: str) -> None:
    """Every variable the rendered replicas get (the pod's, the ConfigMaps') but the tunable
    few is refused in `replicaEnv`, naming it, before --out is touched: `env` wins over
    `envFrom`, so it would replace a connector setting the file sets (or one derived from
    another key) unchecked."""
    objects = rendered(tmp_path, name)
    replica = container(objects, "kvtier-replica")
    variables = {e["name"] for e in replica["env"]} | set(env_of(objects))
    variables |= set(config_map(objects, "kvtier-model"))
    assert "KVTIER_REPLICA_ID" in variables and "MODEL" in variables
    for variable in sorted(variables - TUNABLE_ENV):
        k8s = {**FILES[name].get("kubernetes", {}), "replicaEnv": {variable: "x"}}
        with pytest.raises(ConfigError, match=rf"^kubernetes\.replicaEnv\.{variable}: "):
            render(parse_spec({**FILES[name], "kubernetes": k8s}), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("name", ["cpu-claim", "gated", "gpu-juicefs", "valkey-inside"])
def test_router_env_may_not_override_what_the_overlay_sets(tmp_path: Path, name: str) -> None:
    """As `replicaEnv`: every variable the rendered routers get (the container's, its
    ConfigMaps') but the tunable few and the file's own `routerEnv` is refused in
    `routerEnv`, naming it, before --out is touched."""
    objects = rendered(tmp_path, name)
    router = container(objects, "kvtier-router")
    variables = {e["name"] for e in router["env"]}
    for source in router["envFrom"]:
        variables |= set(by_kind(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    assert {"MODEL", "HOME", "KVTIER_TENANT_SALT_KEY"} <= variables
    own = FILES[name].get("kubernetes", {}).get("routerEnv", {})
    for variable in sorted(variables - TUNABLE_ENV - set(own)):
        k8s = {**FILES[name].get("kubernetes", {}), "routerEnv": {**own, variable: "x"}}
        with pytest.raises(ConfigError, match=rf"^kubernetes\.routerEnv\.{variable}: the over"):
            render(parse_spec({**FILES[name], "kubernetes": k8s}), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"MODEL": "x"}, "sets it from model; set that instead"),
        ({"HOME": "/root"}, r"sets it \(the routers' writable home"),
    ],
)
def test_a_router_env_entry_the_overlay_sets_is_named_with_its_owner(
    tmp_path: Path, env: dict[str, str], error: str
) -> None:
    file = {**FILES["cpu-model"], "kubernetes": {"device": "cpu", "routerEnv": env}}
    with pytest.raises(ConfigError, match=f"kubernetes.routerEnv.{next(iter(env))}: .*{error}"):
        render(parse_spec(file), tmp_path / "out")


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"KVTIER_L1_BYTES": "8GiB"}, "sets it from kvCacheSpec.l1CacheSizeGiB; set that instead"),
        ({"KVTIER_ADMISSION": "reused"}, "a connector setting; give it as kvtier.connector.admi"),
        ({"KVTIER_EVENTS_ENDPOINT": "tcp://0.0.0.0:6000"}, r"sets it \(port 5557, which the ro"),
        ({"OMP_NUM_THREADS": "4"}, "sets it from kvtier.threadsPerReplica"),
    ],
)
def test_a_replica_env_entry_the_overlay_sets_is_named_with_its_owner(
    tmp_path: Path, env: dict[str, str], error: str
) -> None:
    file = {**FILES["cpu-model"], "kubernetes": {"device": "cpu", "replicaEnv": env}}
    with pytest.raises(ConfigError, match=f"kubernetes.replicaEnv.{next(iter(env))}: .*{error}"):
        render(parse_spec(file), tmp_path / "out")


def test_replica_env_keeps_what_the_overlay_leaves_to_the_user(tmp_path: Path) -> None:
    """On GPU the overlay sets no OMP_NUM_THREADS; a hub mirror turns the hub on; a variable
    that is no connector setting (vLLM's message-queue tuning by kvtier's launcher) passes."""
    env = {"OMP_NUM_THREADS": "8", "HF_HUB_OFFLINE": "0", "KVTIER_VLLM_MQ_SPIN_S": "0.5"}
    file = {**FILES["one-router"], "kubernetes": {"replicaEnv": env}}
    render(parse_spec(file), tmp_path / "out")
    replica = container(kustomize(tmp_path / "out"), "kvtier-replica")
    assert {e["name"]: e.get("value") for e in replica["env"]}.items() >= env.items()
