"""A HyperPod InferenceEndpointConfig as a deployment file: every key of the table is mapped
or noted, any other key is an error naming it, and the result renders."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.core.errors import ConfigError
from kvtier.tools.deploy.cli import load_fleet
from kvtier.tools.deploy.hyperpod import MAPPING, from_inference_endpoint_config
from kvtier.tools.deploy.render import find_manifests, render
from kvtier.tools.deploy.settings import EnvFrom
from tests.tools.deploy.kube import container, kustomize, validate

DOCS = find_manifests().parents[1] / "docs" / "kubernetes.md"


def endpoint(**spec: Any) -> dict[str, Any]:
    """A document shaped like the operator's samples (kv cache L1+L2, intelligent routing)."""
    base: dict[str, Any] = {
        "endpointName": "llama-8b-endpoint",
        "modelName": "Llama-3.1-8B-Instruct",
        "instanceType": "ml.g5.8xlarge",
        "invocationEndpoint": "v1/chat/completions",
        "replicas": 3,
        "intelligentRoutingSpec": {"enabled": True, "routingStrategy": "kvaware"},
        "modelSourceConfig": {
            "modelSourceType": "s3",
            "s3Storage": {"bucketName": "models", "region": "us-west-2"},
            "modelLocation": "llama31_8b",
        },
        "kvCacheSpec": {
            "enableL1Cache": True,
            "enableL2Cache": True,
            "l2CacheSpec": {"l2CacheBackend": "tieredstorage"},
        },
        "loadBalancer": {"healthCheckPath": "/health"},
        "worker": {
            "image": "registry.example/kvtier/vllm-gpu:0.2.0",
            "args": ["/opt/ml/model", "--max-model-len", "4096"],
            "environmentVariables": [
                {"name": "PYTHONHASHSEED", "value": "0"},
                {"name": "LMCACHE_REMOTE_SERDE", "value": "naive"},
                {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"},
            ],
            "resources": {
                "limits": {"nvidia.com/gpu": 1},
                "requests": {"cpu": "6", "memory": "30Gi", "nvidia.com/gpu": 1},
            },
            "modelInvocationPort": {"containerPort": 8080, "name": "http"},
            "modelVolumeMount": {"name": "model-weights", "mountPath": "/opt/ml/model"},
        },
    }
    base.update(spec)
    return {
        "apiVersion": "inference.sagemaker.aws.amazon.com/v1",
        "kind": "InferenceEndpointConfig",
        "metadata": {"name": "llama-8b", "namespace": "ns-team-a"},
        "spec": base,
    }


def test_every_known_key_is_mapped() -> None:
    spec, notes = from_inference_endpoint_config(endpoint())
    assert spec.replicas == 3
    assert spec.routing.strategy == "kvaware" and spec.routing.enabled
    assert spec.cache.l2.backend == "tieredstorage" and spec.cache.l2.kind == "posix"
    assert spec.model == "/opt/ml/model"
    k8s = spec.kubernetes
    assert (k8s.namespace, k8s.instance) == ("ns-team-a", "llama-8b")
    assert k8s.node_selector == {"node.kubernetes.io/instance-type": "ml.g5.8xlarge"}
    assert k8s.served_model_name == "Llama-3.1-8B-Instruct"
    assert k8s.image == "registry.example/kvtier/vllm-gpu:0.2.0"
    assert k8s.vllm_args == ["--max-model-len", "4096"]
    assert k8s.replica_env == {"VLLM_LOGGING_LEVEL": "INFO"}
    assert k8s.replica_resources is not None
    assert k8s.replica_resources.requests == {"cpu": "6", "memory": "30Gi", "nvidia.com/gpu": "1"}
    text = "\n".join(notes)
    for dropped in ("PYTHONHASHSEED", "LMCACHE_REMOTE_SERDE", "spec.modelSourceConfig"):
        assert dropped in text
    assert "kubernetes.modelClaim" in text


def test_the_result_renders_and_validates(tmp_path: Path) -> None:
    config = tmp_path / "iec.yaml"
    config.write_text(yaml.safe_dump(endpoint()))
    spec, _ = load_fleet(config)
    render(spec, tmp_path / "out")
    objects = kustomize(tmp_path / "out")
    for obj in objects:
        validate(obj)
    replica = container(objects, "kvtier-replica")
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"} in replica["env"]
    assert all(o["metadata"].get("namespace", "ns-team-a") == "ns-team-a" for o in objects)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kvCacheSpec": {"enableL1Cache": True, "l1CacheSizeGB": 4}},
            "spec.kvCacheSpec.l1CacheSizeGB",
        ),
        ({"workerr": {}}, "spec.workerr: unknown InferenceEndpointConfig key"),
        ({"invocationEndpoint": "invocations"}, "spec.invocationEndpoint"),
        ({"kvCacheSpec": {"cacheConfigFile": "/etc/lmcache.yaml"}}, "cacheConfigFile"),
        (
            {"intelligentRoutingSpec": {"enabled": True, "routingStrategy": "fastest"}},
            "intelligentRoutingSpec.routingStrategy",
        ),
        (
            {"worker": {"args": "/opt/ml/model --max-model-len 4096"}},
            "spec.worker.args: expected a list",
        ),
    ],
)
def test_unknown_or_unmappable_keys_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_inference_endpoint_config(endpoint(**change))


HF_TOKEN = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def test_an_environment_variable_from_a_secret_reaches_the_replicas(tmp_path: Path) -> None:
    doc = endpoint()
    doc["spec"]["worker"]["environmentVariables"].append(HF_TOKEN)
    spec, _ = from_inference_endpoint_config(doc)
    assert spec.kubernetes.replica_env["HF_TOKEN"] == EnvFrom.model_validate(HF_TOKEN["valueFrom"])
    render(spec, tmp_path / "out")
    objects = kustomize(tmp_path / "out")
    for obj in objects:
        validate(obj)
    assert HF_TOKEN in container(objects, "kvtier-replica")["env"]


@pytest.mark.parametrize(
    ("value_from", "message"),
    [
        (
            {"fieldRef": {"fieldPath": "metadata.name"}},
            "environmentVariables[3].valueFrom: fieldRef is not mapped (only secretKeyRef",
        ),
        (
            {"configMapKeyRef": {"name": "settings", "key": "level"}},
            "environmentVariables[3].valueFrom: configMapKeyRef is not mapped",
        ),
        (
            {"resourceFieldRef": {"resource": "limits.memory"}},
            "environmentVariables[3].valueFrom: resourceFieldRef is not mapped",
        ),
        (
            {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}},
            "environmentVariables[3].valueFrom.secretKeyRef: expected {name, key}",
        ),
        ("hf-token", "environmentVariables[3].valueFrom: 'hf-token' is not mapped"),
    ],
)
def test_an_environment_variable_from_anything_but_a_secret_is_named(
    value_from: Any, message: str
) -> None:
    doc = endpoint()
    doc["spec"]["worker"]["environmentVariables"].append({"name": "X", "valueFrom": value_from})
    with pytest.raises(ConfigError, match=re.escape(f"spec.worker.{message}")):
        from_inference_endpoint_config(doc)


def test_the_docs_table_lists_every_key() -> None:
    text = DOCS.read_text()
    for key in MAPPING:
        assert f"`{key}`" in text, key
