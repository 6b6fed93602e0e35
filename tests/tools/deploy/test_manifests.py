"""deploy/k8s: every overlay renders with kubectl and every object is valid for the pinned
Kubernetes version; the wiring the fleet depends on holds in what a cluster would receive."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kvtier.tools.cluster.spec import parse_spec
from kvtier.tools.deploy.commands import (
    replica_args,
    replica_grace_s,
    router_args,
    router_grace_s,
)
from kvtier.tools.deploy.render import find_manifests, render
from tests.tools.deploy.kube import (
    assert_hardened,
    assert_pods_drain_in_grace,
    assert_rollouts_outlast_startup,
    by_kind,
    container,
    kustomize,
    validate,
)

OVERLAYS = sorted(p.name for p in (find_manifests() / "overlays").iterdir())


def test_the_overlays_are_the_documented_ones() -> None:
    assert OVERLAYS == ["cpu", "curvine", "existing-claim", "gpu", "juicefs", "valkey"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_validates(overlay: str) -> None:
    objects = kustomize(find_manifests() / "overlays" / overlay)
    for obj in objects:
        validate(obj)
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "kvtier", obj["metadata"]["name"]
        assert labels.get("app.kubernetes.io/part-of") == "kvtier"
        if obj["kind"] != "Namespace" and obj["kind"] != "StorageClass":
            assert obj["metadata"]["namespace"] == "kvtier"
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    replica = container(objects, "kvtier-replica")
    assert {p["name"]: p["containerPort"] for p in replica["ports"]} == {
        "http": 8000,
        "kv-events": 5557,
        "vllm-events": 5558,
        "vllm-replay": 5559,
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert replica[probe]["httpGet"]["path"] == "/health"
    assert_pods_drain_in_grace(objects)
    assert_rollouts_outlast_startup(objects)
    assert_hardened(objects)
    router = container(objects, "kvtier-router")
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    headless = by_kind(objects, "Service", "kvtier-replicas")
    assert headless["spec"]["clusterIP"] == "None"
    assert "kvtier-replicas:8000" in router["args"]
    pod = by_kind(objects, "Deployment", "kvtier-replica")["spec"]["template"]["metadata"]
    assert pod["labels"]["app.kubernetes.io/component"] == "replica"


def test_validation_rejects_what_a_cluster_would() -> None:
    objects = kustomize(find_manifests() / "overlays" / "cpu")
    deployment = copy.deepcopy(by_kind(objects, "Deployment", "kvtier-replica"))
    deployment["spec"]["template"]["spec"]["containers"][0]["argz"] = ["typo"]
    with pytest.raises(Exception, match="argz"):
        validate(deployment)
    monitor = copy.deepcopy(by_kind(kustomize(_with_monitor()), "ServiceMonitor", "kvtier"))
    validate(monitor)
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(Exception, match="intervall"):
        validate(monitor)


def _with_monitor() -> Path:
    return find_manifests() / "components" / "servicemonitor"


def test_network_policies_allow_only_the_fleets_flows() -> None:
    objects = kustomize(find_manifests() / "overlays" / "valkey")
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    replica_in = policies["kvtier-replica"]["ingress"]
    assert replica_in == [
        {
            "from": [
                {
                    "podSelector": {
                        "matchLabels": {
                            "app.kubernetes.io/name": "kvtier",
                            "app.kubernetes.io/component": "router",
                        }
                    }
                }
            ],
            "ports": [
                {"protocol": "TCP", "port": 8000},
                {"protocol": "TCP", "port": 5557},
                {"protocol": "TCP", "port": 5558},
                {"protocol": "TCP", "port": 5559},
            ],
        }
    ]
    router_out = policies["kvtier-router"]["egress"]
    assert [p["port"] for p in router_out[0]["ports"]] == [8000, 5557, 5558, 5559]
    assert router_out[1]["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    valkey_in = policies["kvtier-valkey"]["ingress"][0]
    assert valkey_in["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "replica"
    )
    assert policies["kvtier-valkey"]["policyTypes"] == ["Ingress", "Egress"]
    assert "egress" not in policies["kvtier-valkey"]  # Valkey reaches nothing


def test_the_bases_command_lines_are_what_render_writes() -> None:
    """The base (GPU) and the cpu component hold the command lines `render` builds for a
    default file, so a static overlay and a rendered one run the same commands."""
    gpu = kustomize(find_manifests() / "overlays" / "gpu")
    cpu = kustomize(find_manifests() / "overlays" / "cpu")
    gpu_spec = parse_spec({"model": "Qwen/Qwen2-7B-Instruct"})
    cpu_spec = parse_spec({"kubernetes": {"device": "cpu"}})
    assert container(gpu, "kvtier-replica")["args"] == replica_args(gpu_spec)
    assert container(cpu, "kvtier-replica")["args"] == replica_args(cpu_spec)
    assert container(gpu, "kvtier-router")["args"] == router_args(gpu_spec)
    for deployment, grace_s in (
        ("kvtier-replica", replica_grace_s),
        ("kvtier-router", router_grace_s),
    ):
        pod = by_kind(gpu, "Deployment", deployment)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace_s(gpu_spec)


@pytest.mark.parametrize(
    ("overlay", "file"),
    [("gpu", {"model": "Qwen/Qwen2-7B-Instruct"}), ("cpu", {"kubernetes": {"device": "cpu"}})],
)
def test_the_static_replicas_are_sized_and_placed_as_render_does(
    tmp_path: Path, overlay: str, file: dict[str, Any]
) -> None:
    """The base and the components hold what `render` writes for a default file: memory for
    vLLM, the L1 and /dev/shm, the model cache (a downloaded model), the GPU toleration."""
    render(parse_spec(file), tmp_path / "out")
    static = kustomize(find_manifests() / "overlays" / overlay)
    ours = kustomize(tmp_path / "out")
    pods = [
        by_kind(o, "Deployment", "kvtier-replica")["spec"]["template"]["spec"]
        for o in (static, ours)
    ]
    for key in ("tolerations", "volumes", "securityContext"):
        assert pods[0].get(key) == pods[1].get(key), key
    mains = [pod["containers"][0] for pod in pods]
    for key in ("resources", "volumeMounts", "securityContext"):
        assert mains[0].get(key) == mains[1].get(key), key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_are_offline_unless_the_hub_is_reachable(overlay: str) -> None:
    """The pods run offline (HF_HUB_OFFLINE=1) unless hub-egress lets them out (the model is an
    HF id), whatever their image sets."""
    objects = kustomize(find_manifests() / "overlays" / overlay)
    hub = any(o["metadata"]["name"] == "kvtier-model-download" for o in objects)
    for deployment in ("kvtier-replica", "kvtier-router"):
        env = {e["name"]: e.get("value") for e in container(objects, deployment)["env"]}
        assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == ("0" if hub else "1")
