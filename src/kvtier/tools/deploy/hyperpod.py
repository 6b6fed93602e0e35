"""A SageMaker HyperPod `InferenceEndpointConfig` read as a kvtier deployment file.

Every key HyperPod's CRD defines is in `MAPPING`: where it goes in the deployment file, or why
it has no effect on a kvtier fleet (a note for the user). A key that is not in the table is a
`ConfigError` naming its full path, so a typo or a newer CRD field is never silently dropped.
docs/kubernetes.md shows the table.

    spec, notes = from_inference_endpoint_config(yaml.safe_load(text))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import FleetSpec, parse_spec

__all__ = ["API_VERSIONS", "MAPPING", "from_inference_endpoint_config", "is_hyperpod"]

API_VERSIONS = (
    "inference.sagemaker.aws.amazon.com/v1",
    "inference.sagemaker.aws.amazon.com/v1alpha1",
)
KIND = "InferenceEndpointConfig"
OPENAI_PATHS = ("v1/chat/completions", "v1/completions")
NOT_NEEDED_ENV = ("LMCACHE_", "PYTHONHASHSEED")
"""LMCache's settings, and the hash seed LMCache needs pinned: kvtier's hashes are seedless."""

Fleet = dict[str, Any]
Apply = Callable[[Any, Fleet, dict[str, Any], list[str]], None]
"""apply(value, fleet, the document's spec, notes)."""


def is_hyperpod(doc: object) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == KIND


def _put(fleet: Fleet, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = fleet
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _to(path: str) -> Apply:
    return lambda value, fleet, spec, notes: _put(fleet, path, value)


def _note(text: str) -> Apply:
    return lambda value, fleet, spec, notes: notes.append(text)


def _check(key: str, allowed: tuple[str, ...]) -> Apply:
    def apply(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")

    return apply


def _invocation(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    if str(value).strip("/") not in OPENAI_PATHS:
        raise ConfigError(
            f"spec.invocationEndpoint: {value!r}: kvtier's router serves the OpenAI API "
            f"({', '.join(OPENAI_PATHS)})"
        )


def _initial_replicas(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    if "replicas" not in spec:
        fleet["replicas"] = value


def _instance_type(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    _put(fleet, "kubernetes.nodeSelector", {"node.kubernetes.io/instance-type": value})


def _cache_config_file(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    raise ConfigError(
        "spec.kvCacheSpec.cacheConfigFile: an LMCache configuration file; give kvtier's "
        "connector settings under kvtier.connector instead"
    )


def _worker_args(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    if not isinstance(value, list | None):
        raise ConfigError(f"spec.worker.args: expected a list of strings, got {value!r}")
    args = [str(a) for a in value or ()]
    if args and not args[0].startswith("-"):
        fleet["model"] = args.pop(0)
    if args:
        _put(fleet, "kubernetes.vllmArgs", args)


def _worker_env(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    env: dict[str, Any] = {}
    for i, entry in enumerate(value or ()):
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"spec.worker.environmentVariables[{i}]: expected {{name, value}}")
        name = str(entry["name"])
        if name.startswith(NOT_NEEDED_ENV):
            notes.append(f"spec.worker.environmentVariables: {name} dropped (LMCache only)")
        elif "valueFrom" in entry:
            env[name] = _value_from(entry["valueFrom"], f"spec.worker.environmentVariables[{i}]")
        else:
            env[name] = str(entry.get("value", ""))
    if env:
        _put(fleet, "kubernetes.replicaEnv", env)


def _value_from(value: Any, where: str) -> dict[str, Any]:
    """A `valueFrom` as `replicaEnv` takes it: a key of a Secret ({secretKeyRef: {name, key}});
    a ConfigMap's key, a pod field, a resource or an optional Secret are not mapped."""
    kinds = sorted(value) if isinstance(value, dict) else []
    if kinds != ["secretKeyRef"]:
        raise ConfigError(
            f"{where}.valueFrom: {', '.join(kinds) or repr(value)} is not mapped (only "
            "secretKeyRef becomes kubernetes.replicaEnv); add it to the rendered overlay with "
            "a patch"
        )
    ref = value["secretKeyRef"]
    if not isinstance(ref, dict) or set(ref) != {"name", "key"}:
        raise ConfigError(
            f"{where}.valueFrom.secretKeyRef: expected {{name, key}}, got {ref!r} (an optional "
            "Secret is not mapped)"
        )
    return {"secretKeyRef": {"name": str(ref["name"]), "key": str(ref["key"])}}


def _worker_resources(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    if not isinstance(value, dict) or set(value) - {"requests", "limits"}:
        raise ConfigError("spec.worker.resources: only requests and limits are mapped")
    resources = {part: {k: str(v) for k, v in (value.get(part) or {}).items()} for part in value}
    _put(fleet, "kubernetes.replicaResources", resources)


def _model_mount(value: Any, fleet: Fleet, spec: dict[str, Any], notes: list[str]) -> None:
    path = (value or {}).get("mountPath", "/opt/ml/model")
    _put(fleet, "kubernetes.modelMountPath", path)
    fleet.setdefault("model", path)
    notes.append(
        "spec.worker.modelVolumeMount: set kubernetes.modelClaim to the claim holding the "
        f"weights (mounted at {path})"
    )


_SAGEMAKER = "SageMaker endpoint registration: not part of a kvtier fleet"

MAPPING: dict[str, tuple[str, Apply]] = {
    "apiVersion": ("checked", _check("apiVersion", API_VERSIONS)),
    "kind": ("checked", _check("kind", (KIND,))),
    "metadata.name": ("kubernetes.instance", _to("kubernetes.instance")),
    "metadata.namespace": ("kubernetes.namespace", _to("kubernetes.namespace")),
    "metadata.labels": ("no effect", _note("metadata.labels: not carried over")),
    "metadata.annotations": ("no effect", _note("metadata.annotations: not carried over")),
    "spec.replicas": ("replicas", _to("replicas")),
    "spec.InitialReplicaCount": ("replicas (when spec.replicas is absent)", _initial_replicas),
    "spec.instanceType": (
        "kubernetes.nodeSelector (node.kubernetes.io/instance-type)",
        _instance_type,
    ),
    "spec.modelName": ("kubernetes.servedModelName", _to("kubernetes.servedModelName")),
    "spec.invocationEndpoint": ("checked: an OpenAI path", _invocation),
    "spec.endpointName": ("no effect", _note(f"spec.endpointName: {_SAGEMAKER}")),
    "spec.modelVersion": ("no effect", _note(f"spec.modelVersion: {_SAGEMAKER}")),
    "spec.tags": ("no effect", _note(f"spec.tags: {_SAGEMAKER}")),
    "spec.tlsConfig": ("no effect", _note("spec.tlsConfig: terminate TLS in front of the router")),
    "spec.modelSourceConfig": (
        "no effect",
        _note(
            "spec.modelSourceConfig: kvtier does not fetch weights from S3 or FSx; put them on "
            "a claim (kubernetes.modelClaim) or give an HF id as model"
        ),
    ),
    "spec.autoScalingSpec": (
        "no effect",
        _note("spec.autoScalingSpec: scale Deployment kvtier-replica with an HPA or KEDA"),
    ),
    "spec.metrics.enabled": ("kubernetes.serviceMonitor", _to("kubernetes.serviceMonitor")),
    "spec.metrics.metricsScrapeIntervalSeconds": (
        "no effect",
        _note("spec.metrics.metricsScrapeIntervalSeconds: the ServiceMonitor scrapes every 15 s"),
    ),
    "spec.metrics.modelMetrics": (
        "no effect",
        _note("spec.metrics.modelMetrics: replicas are scraped at :8000/metrics"),
    ),
    "spec.intelligentRoutingSpec.enabled": (
        "intelligentRoutingSpec.enabled",
        _to("intelligentRoutingSpec.enabled"),
    ),
    "spec.intelligentRoutingSpec.routingStrategy": (
        "intelligentRoutingSpec.routingStrategy",
        _to("intelligentRoutingSpec.routingStrategy"),
    ),
    "spec.intelligentRoutingSpec.autoScalingSpec": (
        "no effect",
        _note("spec.intelligentRoutingSpec.autoScalingSpec: scale Deployment kvtier-router"),
    ),
    "spec.kvCacheSpec.enableL1Cache": (
        "kvCacheSpec.enableL1Cache",
        _to("kvCacheSpec.enableL1Cache"),
    ),
    "spec.kvCacheSpec.enableL2Cache": (
        "kvCacheSpec.enableL2Cache",
        _to("kvCacheSpec.enableL2Cache"),
    ),
    "spec.kvCacheSpec.l2CacheSpec.l2CacheBackend": (
        "kvCacheSpec.l2CacheSpec.l2CacheBackend (tieredstorage: a ReadWriteMany claim)",
        _to("kvCacheSpec.l2CacheSpec.l2CacheBackend"),
    ),
    "spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl": (
        "kvCacheSpec.l2CacheSpec.l2CacheLocalUrl",
        _to("kvCacheSpec.l2CacheSpec.l2CacheLocalUrl"),
    ),
    "spec.kvCacheSpec.cacheConfigFile": ("error: use kvtier.connector", _cache_config_file),
    "spec.loadBalancer.healthCheckPath": (
        "no effect",
        _note("spec.loadBalancer.healthCheckPath: the router's health is GET /health"),
    ),
    "spec.loadBalancer.routingAlgorithm": (
        "no effect",
        _note("spec.loadBalancer.routingAlgorithm: Service kvtier-router spreads connections"),
    ),
    "spec.worker.image": ("kubernetes.image (kvtier installed on vLLM)", _to("kubernetes.image")),
    "spec.worker.args": ("model (a first non-flag argument), kubernetes.vllmArgs", _worker_args),
    "spec.worker.environmentVariables": (
        "kubernetes.replicaEnv (valueFrom: secretKeyRef only; LMCACHE_*, PYTHONHASHSEED dropped)",
        _worker_env,
    ),
    "spec.worker.resources": ("kubernetes.replicaResources", _worker_resources),
    "spec.worker.modelInvocationPort": (
        "no effect",
        _note("spec.worker.modelInvocationPort: replicas listen on 8000 inside their pod"),
    ),
    "spec.worker.modelVolumeMount": ("kubernetes.modelMountPath, model", _model_mount),
}
"""HyperPod key -> (where it goes, how it is applied)."""


def from_inference_endpoint_config(doc: object) -> tuple[FleetSpec, list[str]]:
    """The deployment file an InferenceEndpointConfig stands for, and notes on what it set
    that has no effect here. Raises ConfigError naming any key it does not know."""
    if not is_hyperpod(doc):
        raise ConfigError(f"kind: expected {KIND}")
    assert isinstance(doc, dict)
    fleet: Fleet = {}
    notes: list[str] = []
    spec = doc.get("spec") or {}
    if not isinstance(spec, dict):
        raise ConfigError("spec: must be a mapping")
    _walk(doc, "", fleet, spec, notes)
    return parse_spec(fleet), notes


def _walk(
    node: dict[str, Any], prefix: str, fleet: Fleet, spec: dict[str, Any], notes: list[str]
) -> None:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path in MAPPING:
            MAPPING[path][1](value, fleet, spec, notes)
        elif isinstance(value, dict) and any(k.startswith(path + ".") for k in MAPPING):
            _walk(value, path + ".", fleet, spec, notes)
        elif path == "status":
            continue  # written by the operator
        else:
            known = sorted(
                {k[len(prefix) :].split(".")[0] for k in MAPPING if k.startswith(prefix)}
            )
            raise ConfigError(
                f"{path}: unknown InferenceEndpointConfig key (known here: {', '.join(known)})"
            )
