"""Rendering and checking manifests as a cluster would: `kubectl kustomize`, then every object
against the Kubernetes API schema of `KUBERNETES_VERSION` (kubernetes-validate, strict: unknown
fields are errors) and the ServiceMonitor against its CRD schema (vendored in schemas/)."""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvtier.router.settings import RouterSettings

KUBERNETES_VERSION = "1.33"
"""Pinned: the oldest minor version EKS still offers standard support for."""
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json"}


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed")
    return found


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize path`, parsed."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {path}:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def _crd_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / name).read_text())
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not a valid object of the pinned Kubernetes version (or its CRD)."""
    crd = CRD_SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if crd is not None:
        jsonschema.Draft202012Validator(_crd_schema(crd)).validate(obj)
        return
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def by_kind(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def container(objects: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    pod = by_kind(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    first: dict[str, Any] = pod["containers"][0]
    return first


def assert_pods_drain_in_grace(objects: list[dict[str, Any]]) -> tuple[int, int]:
    """Both pods' grace periods cover their drains (see below); returns (replica's, router's)."""
    replica = _assert_drains_in_grace(objects, "kvtier-replica", "--shutdown-timeout")
    default = RouterSettings.model_fields["drain_s"].default
    return replica, _assert_drains_in_grace(objects, "kvtier-router", "--drain-s", default)


def _assert_drains_in_grace(
    objects: list[dict[str, Any]], deployment: str, flag: str, default: int | None = None
) -> int:
    """The `deployment` pod's grace period covers its preStop sleep, the drain of the requests
    in flight (its container's `flag`, else `default`) and some seconds to exit; returns the
    drain."""
    pod = by_kind(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    main = pod["containers"][0]
    pre_stop = main["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep", pre_stop
    args = main["args"]
    assert args.count(flag) == 1 or (default is not None and flag not in args), args
    drain = int(args[args.index(flag) + 1]) if flag in args else default
    assert drain is not None
    assert pod["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain + 5, pod
    return drain


def assert_rollouts_outlast_startup(objects: list[dict[str, Any]]) -> None:
    """A replica rollout is not reported failed while a pod still loads its model (its
    progress deadline outlasts the startup probe's budget), and readiness probes wait 5 s for
    an answer (the default, 1 s, takes a busy pod out of the Service)."""
    replicas = by_kind(objects, "Deployment", "kvtier-replica")["spec"]
    probe = container(objects, "kvtier-replica")["startupProbe"]
    budget = (
        probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    )
    assert replicas.get("progressDeadlineSeconds", 600) > budget, probe
    for deployment in ("kvtier-replica", "kvtier-router"):
        assert container(objects, deployment)["readinessProbe"].get("timeoutSeconds", 1) >= 5


def assert_hardened(objects: list[dict[str, Any]]) -> None:
    """Every pod runs under the runtime's seccomp profile, its containers without privilege
    escalation or capabilities; the routers and Valkey as a non-root user (Pod Security
    "restricted"), the replicas as the vLLM image's root (docs/kubernetes.md)."""
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, obj
        for main in pod["containers"]:
            context = main["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, obj["metadata"]["name"]
            assert context["capabilities"] == {"drop": ["ALL"]}, obj["metadata"]["name"]
        if obj["metadata"]["name"] != "kvtier-replica":
            assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
            assert pod["securityContext"]["runAsUser"] > 0, obj["metadata"]["name"]
