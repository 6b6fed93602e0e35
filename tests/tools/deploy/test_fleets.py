"""Two fleets in one namespace (`kubernetes.fleetName`): no object of one replaces an object of
the other (nor a cluster-scoped one: StorageClasses), no selector of one picks the other's pods
or Services, and each one's router and replicas reach its own Services."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import parse_spec
from kvtier.tools.deploy.render import render
from tests.tools.deploy.kube import container, kustomize, validate
from tests.tools.deploy.test_render import FILES

NAMESPACE = "models"
PAIRS = [
    ("valkey-persistent", "valkey-inside"),  # Valkey StatefulSets, Services, Secrets
    ("gpu-curvine", "curvine-local"),  # two kvtier-curvine StorageClasses (cluster-scoped)
    ("gpu-juicefs", "juicefs-nfs"),
    ("cpu-claim", "valkey-outside"),  # CPU replicas; the external Valkey's policy
]
SELECTORS = ("selector", "podSelector", "labelSelector")


def fleet(tmp_path: Path, file: str, name: str) -> list[dict[str, Any]]:
    """FILES[file] rendered as fleet `name` in NAMESPACE, with a ServiceMonitor."""
    k8s = {**FILES[file].get("kubernetes", {}), "fleetName": name, "namespace": NAMESPACE}
    k8s["serviceMonitor"] = True
    render(parse_spec({**FILES[file], "kubernetes": k8s}), tmp_path / name)
    objects = kustomize(tmp_path / name)
    for obj in objects:
        validate(obj)
    return objects


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector, or a Service's selector (plain labels), selects `labels`."""
    if not {"matchLabels", "matchExpressions"} & set(selector):
        return selector.items() <= labels.items()
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        held = {
            "In": key in labels and labels[key] in (values or ()),
            "NotIn": key not in labels or labels[key] not in (values or ()),
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not held:
            return False
    return True


def selectors(node: Any, where: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (where, selector) in `node`: workloads', Services', budgets', policies' and their
    peers', spread constraints', the ServiceMonitor's."""
    found = []
    if isinstance(node, dict):
        items: list[tuple[Any, Any]] = list(node.items())
    else:
        items = list(enumerate(node)) if isinstance(node, list) else []
    for key, value in items:
        if key in SELECTORS and isinstance(value, dict):
            found.append((f"{where}.{key}", value))
        else:
            found += selectors(value, f"{where}.{key}")
    return found


def pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The pod labels of each workload."""
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }


def service_selecting(objects: list[dict[str, Any]], name: str, component: str) -> None:
    """`name` is a Service of `objects` selecting their `component` pods."""
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name]
    selected = [
        labels for labels in pods(objects).values() if matches(service["spec"]["selector"], labels)
    ]
    components = {labels["app.kubernetes.io/component"] for labels in selected}
    assert selected and components == {component}, (name, components)


def references(objects: list[dict[str, Any]]) -> set[str]:
    """Names of other objects the fleet's pods and claims use: ConfigMaps, Secrets, claims,
    StorageClasses, a StatefulSet's Service."""
    names: set[str] = set()
    for obj in objects:
        spec = obj.get("spec", {})
        if obj["kind"] == "PersistentVolumeClaim" and "storageClassName" in spec:
            names.add(spec["storageClassName"])
        if obj["kind"] == "StatefulSet":
            names.add(spec["serviceName"])
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = spec["template"]["spec"]
        for main in pod["containers"]:
            for source in main.get("envFrom", []):
                names.add(source["configMapRef"]["name"])
            for env in main.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    names.add(ref["name"])
        for volume in pod.get("volumes", []):
            names.add(volume.get("secret", {}).get("secretName", ""))
            names.add(volume.get("persistentVolumeClaim", {}).get("claimName", ""))
    return names - {""}


@pytest.mark.parametrize(("file_a", "file_b"), PAIRS)
def test_two_fleets_share_a_namespace(tmp_path: Path, file_a: str, file_b: str) -> None:
    a, b = fleet(tmp_path, file_a, "a"), fleet(tmp_path, file_b, "b")

    # no object of one is an object of the other (cluster-scoped ones have no namespace)
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in a + b]
    assert sorted(k for k in keys if keys.count(k) > 1) == []
    assert not [o for o in a + b if o["kind"] == "Namespace"]  # shared: created by the user

    for mine, theirs in ((a, b), (b, a)):
        # no selector picks the other fleet's pods or Services ...
        targets = list(pods(theirs).values())
        targets += [o["metadata"]["labels"] for o in theirs if o["kind"] == "Service"]
        for obj in mine:
            for where, selector in selectors(obj.get("spec", {})):
                picked = [labels for labels in targets if matches(selector, labels)]
                assert not picked, (obj["kind"], obj["metadata"]["name"], where, picked)
        # ... while each workload's selects its own pods and the ServiceMonitor its Services
        for obj in mine:
            if obj["kind"] in ("Deployment", "StatefulSet"):
                assert matches(obj["spec"]["selector"], pods(mine)[obj["metadata"]["name"]])
        (monitor,) = [o for o in mine if o["kind"] == "ServiceMonitor"]
        services = {o["metadata"]["name"]: o for o in mine if o["kind"] == "Service"}
        monitored = {
            name
            for name, service in services.items()
            if matches(monitor["spec"]["selector"], service["metadata"]["labels"])
        }
        prefix = mine[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
        assert monitored == {f"{prefix}-kvtier-router", f"{prefix}-kvtier-replicas"}

        # the names the containers reach are the fleet's own Services
        router = container(mine, f"{prefix}-kvtier-router")["args"]
        host, _, port = router[router.index("--replicas-dns") + 1].partition(":")
        service_selecting(mine, host, "replica")
        replica = container(mine, f"{prefix}-kvtier-replica")
        env = {e["name"]: e for e in replica.get("env", [])}
        url = env.get("KVTIER_L2_URL", {}).get("value", "")
        if "$(VALKEY_PASSWORD)@" in url:  # the in-cluster Valkey's
            service_selecting(mine, url.partition("@")[2].partition(":")[0], "valkey")
            names = [e["name"] for e in replica["env"]]
            assert names.index("VALKEY_PASSWORD") < names.index("KVTIER_L2_URL")  # $(VAR)
        for obj in mine:
            if obj["kind"] == "StatefulSet":
                service_selecting(mine, obj["spec"]["serviceName"], "valkey")
        # and every object they use is the fleet's own (or the user's: weights, efs-kv, ...)
        assert not references(mine) & {o["metadata"]["name"] for o in theirs}


def test_a_named_fleet_leaves_the_namespace_to_the_user_unless_told(tmp_path: Path) -> None:
    file = {**FILES["cpu-claim"], "kubernetes": {"device": "cpu", "fleetName": "small"}}
    render(parse_spec(file), tmp_path / "named")
    assert not [o for o in kustomize(tmp_path / "named") if o["kind"] == "Namespace"]
    file["kubernetes"]["createNamespace"] = True
    render(parse_spec(file), tmp_path / "owner")
    (namespace,) = [o for o in kustomize(tmp_path / "owner") if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == "kvtier"
    file["kubernetes"] = {"device": "cpu", "createNamespace": False}  # a lone fleet, too
    render(parse_spec(file), tmp_path / "lone")
    assert not [o for o in kustomize(tmp_path / "lone") if o["kind"] == "Namespace"]


@pytest.mark.parametrize(
    ("kubernetes", "error"),
    [
        ({"fleetName": "Qwen"}, r"kubernetes\.fleetName: not a DNS label"),
        ({"fleetName": "q" * 31}, r"kubernetes\.fleetName: .*at most 30"),
        ({"fleetName": "qwen", "instance": "prod"}, r"kubernetes\.instance: with fleetName"),
    ],
)
def test_a_bad_fleet_name_is_refused(kubernetes: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_spec({"kubernetes": kubernetes})
