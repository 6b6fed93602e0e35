"""Kustomize patches of the base's objects, as the overlay's kustomization.yaml lists them.

Strategic-merge patches of a Deployment (`container_patch`, then `schedule`, `volumes`,
`mount_model` fill it in), a container's `env` entries, and inline patches of other objects
(`inline`, `DELETE_NAMESPACE`). Pure builders of dicts: the caller writes them; lists a
strategic merge does not merge by name (tolerations) replace the base's.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvtier.tools.deploy.settings import Affinity, Env, Toleration

__all__ = [
    "DELETE_NAMESPACE",
    "container_patch",
    "env_entries",
    "inline",
    "mount_model",
    "schedule",
    "volumes",
]


def container_patch(deployment: str, container: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment},
        "spec": {"template": {"spec": {"containers": [{"name": container, "image": image}]}}},
    }


def env_entries(env: Env) -> list[dict[str, Any]]:
    """A container's `env` entries (merged by name into the base's)."""
    return [
        {"name": k, "value": v}
        if isinstance(v, str)
        else {"name": k, "valueFrom": v.model_dump(by_alias=True)}
        for k, v in env.items()
    ]


def schedule(
    patch: dict[str, Any],
    *,
    node_selector: dict[str, str],
    tolerations: list[Toleration],
    affinity: Affinity | None,
    priority_class: str | None,
    labels: dict[str, str],
    annotations: dict[str, str],
) -> None:
    """Where a Deployment's pods run (nodes, priority), their extra labels and annotations.
    Tolerations replace the base's (a list a patch does not merge): the GPU one included."""
    template = patch["spec"]["template"]
    pod = template["spec"]
    if tolerations:
        pod["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    if node_selector:
        pod["nodeSelector"] = dict(node_selector)
    if affinity is not None:
        pod["affinity"] = affinity.model_dump(by_alias=True, exclude_none=True)
    if priority_class is not None:
        pod["priorityClassName"] = priority_class
    metadata = {"labels": dict(labels), "annotations": dict(annotations)}
    template["metadata"] = {key: value for key, value in metadata.items() if value}


def volumes(patch: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's volumes in a Deployment patch (merged by name into the base's)."""
    found: list[dict[str, Any]] = patch["spec"]["template"]["spec"].setdefault("volumes", [])
    return found


def mount_model(patch: dict[str, Any], claim: str, path: str) -> None:
    container = patch["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [{"name": "model", "mountPath": path, "readOnly": True}]
    volumes(patch).append({"name": "model", "persistentVolumeClaim": {"claimName": claim}})


def inline(kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    version = {
        "StorageClass": "storage.k8s.io/v1",
        "ServiceMonitor": "monitoring.coreos.com/v1",
    }.get(kind, "v1")
    metadata = {"name": name, **body.get("metadata", {})}
    doc = {"apiVersion": version, "kind": kind, **body, "metadata": metadata}
    return {"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(doc)}


DELETE_NAMESPACE = {
    "target": {"kind": "Namespace"},
    "patch": yaml.safe_dump(
        {"$patch": "delete", "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}
    ),
}
"""Leaves the base's Namespace out (`kubernetes.createNamespace`)."""
