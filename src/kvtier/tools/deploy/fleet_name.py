"""A named fleet (`kubernetes.fleetName`) sharing a namespace with others.

The overlay renames every object of the base with the namePrefix `<fleet>-` (`object_name` says
what one is then called), and `fleet_selectors` adds the fleet's name as one more label
(`INSTANCE_LABEL`) to every selector of kvtier's pods in the copied manifests, so that no
selector of one fleet picks another's pods. Both are pure: the selectors are read from the
copied manifests, nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvtier.tools.cluster.spec import FleetSpec

__all__ = ["INSTANCE_LABEL", "NAME_LABEL", "fleet_selectors", "object_name"]

NAME_LABEL = "app.kubernetes.io/name"
"""Selects kvtier's pods (with `app.kubernetes.io/component`) in every selector of the base."""
INSTANCE_LABEL = "app.kubernetes.io/instance"
"""Selects a named fleet's pods (`kubernetes.fleetName`) besides `NAME_LABEL`."""


def object_name(spec: FleetSpec, name: str) -> str:
    """The fleet's object of the base's `name` (kvtier-replicas): prefixed by
    `kubernetes.fleetName`, as the overlay's namePrefix renames it."""
    fleet = spec.kubernetes.fleet_name
    return name if fleet is None else f"{fleet}-{name}"


def fleet_selectors(build: Path, fleet: str) -> list[dict[str, Any]]:
    """Patches adding `INSTANCE_LABEL: fleet` to every selector of kvtier's pods (one naming
    `NAME_LABEL: kvtier`) in the copied manifests: workloads, Services, disruption budgets,
    network policies and their peers, spread constraints, the ServiceMonitor. Kustomize's
    label transformer with selectors would also rewrite the policies' kube-dns peer."""
    patches = []
    for directory in [build / "base", *sorted((build / "components").iterdir())]:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        for resource in kustomization.get("resources", []):
            for doc in yaml.safe_load_all((directory / resource).read_text()):
                ops = [
                    {"op": "add", "path": path, "value": value}
                    for path, value in _selector_additions(doc, "", fleet)
                ]
                if ops:
                    target = {"kind": doc["kind"], "name": doc["metadata"]["name"]}
                    patches.append({"target": target, "patch": yaml.safe_dump(ops)})
    return patches


def _selector_additions(node: Any, path: str, fleet: str) -> Iterator[tuple[str, Any]]:
    """(JSON pointer, value) pairs adding the fleet's label to kvtier's selectors in `node`."""
    if isinstance(node, dict):
        items: list[tuple[Any, Any]] = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return
    label = INSTANCE_LABEL.replace("/", "~1")
    for key, value in items:
        here = f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
        if key not in ("selector", "podSelector", "labelSelector") or not _selects_kvtier(value):
            yield from _selector_additions(value, here, fleet)
        elif NAME_LABEL in value:  # a Service's: labels, not a LabelSelector
            yield f"{here}/{label}", fleet
        elif "matchLabels" in value:
            yield f"{here}/matchLabels/{label}", fleet
        else:
            yield f"{here}/matchLabels", {INSTANCE_LABEL: fleet}


def _selects_kvtier(selector: Any) -> bool:
    if not isinstance(selector, dict):
        return False
    labels = selector.get("matchLabels", selector)
    expressions = selector.get("matchExpressions", [])
    return labels.get(NAME_LABEL) == "kvtier" or any(
        e["key"] == NAME_LABEL and e["operator"] == "In" and "kvtier" in e["values"]
        for e in expressions
    )
