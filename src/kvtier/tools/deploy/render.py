"""The Kubernetes overlay of a deployment file: `kvtier deploy render --config F --out DIR`.

The manifests live in `deploy/k8s` (a kustomize base, and one component per option). Rendering
copies the base and the components the file asks for into DIR and writes DIR/kustomization.yaml
with what the file sets: replica and router counts, images, the router's flags, resources, the
L2 volume or Valkey, and generated secrets (the router's API key, Valkey's password) that a later
render keeps; the connector's settings (the `KVTIER_*` environment of the replicas) and the
model go in a last component, DIR/components/fleet. `kubectl apply -k DIR` deploys it; DIR holds
no reference to this checkout. DIR is new, empty, or an earlier render's (nothing else is
overwritten); the overlay is written beside the old one and replaces it only once it is whole
(`out_dir`). A named fleet (`kubernetes.fleetName`) gets a namePrefix, and its name as one more
label in every selector of kvtier's pods, so that fleets share a namespace (`fleet_name`).

    spec = load_spec(Path("fleet.yaml"))
    notes = render(spec, Path("out"))       # notes: what the file set that has no effect here

This module assembles the overlay; its parts are built beside it: the container command lines
(`commands`), their environment (`env`), resources (`resources`), the L2 (`l2_volume`,
`valkey`), and the patches they go in (`patches`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import FleetSpec
from kvtier.tools.deploy.commands import replica_args, replica_grace_s, router_args, router_grace_s
from kvtier.tools.deploy.env import check_env, connector_env, rendered_env, rendered_router_env
from kvtier.tools.deploy.fleet_name import INSTANCE_LABEL, fleet_selectors
from kvtier.tools.deploy.l2_volume import l2_volume, volume_patches
from kvtier.tools.deploy.out_dir import HEADER, replacing, secret
from kvtier.tools.deploy.patches import (
    DELETE_NAMESPACE,
    container_patch,
    env_entries,
    inline,
    mount_model,
    schedule,
    volumes,
)
from kvtier.tools.deploy.resources import GPU, check_memory, replica_memory_gib, resources_block
from kvtier.tools.deploy.settings import Env, Toleration
from kvtier.tools.deploy.valkey import external_valkey_policy, valkey_env, valkey_patch

__all__ = ["EMBEDDED_MODEL", "find_manifests", "render"]

EMBEDDED_MODEL = "/opt/kvtier/model"
"""Where the CPU image (deploy/docker/Dockerfile.cpu) keeps the embedded model."""
EMBEDDED_NAME = "SmolLM2-135M-Instruct-bf16"
IMAGES = {"gpu": "kvtier/vllm-gpu:0.2.0", "cpu": "kvtier/vllm-cpu:0.2.0"}
GPU_TOLERATION = Toleration(key=GPU, operator="Exists", effect="NoSchedule")
"""Tolerated by GPU replicas (deploy/k8s/base/replicas.yaml): the taint of GPU nodes on EKS
(Karpenter, GPU node groups) and GKE."""
MODEL_CACHE = "model-cache"
"""The replicas' download cache volume (deploy/k8s/components/model-cache)."""
FLEET_COMPONENT = "fleet"
"""The component `render` writes with the file's ConfigMaps. Kustomize applies components in
order, after the overlay's own generators, so these must be in the last one to win over the
defaults that the shipped components (cpu, valkey, l2-*) generate."""


def find_manifests() -> Path:
    """`deploy/k8s` of this checkout ($KVTIER_DEPLOY_DIR overrides)."""
    given = os.environ.get("KVTIER_DEPLOY_DIR")
    candidates = [Path(given)] if given else []
    candidates += [p / "deploy" / "k8s" for p in Path(__file__).resolve().parents]
    for path in candidates:
        if (path / "base" / "kustomization.yaml").is_file():
            return path
    raise ConfigError(
        "deploy/k8s not found: run from a kvtier checkout or set KVTIER_DEPLOY_DIR to it"
    )


def _model(spec: FleetSpec) -> tuple[str, str]:
    """(MODEL, SERVED_MODEL_NAME) of the fleet."""
    k8s = spec.kubernetes
    if spec.model is None:
        if k8s.device == "gpu":
            raise ConfigError(
                "model: required for GPU replicas (an HF id, or a path in the image or under "
                "kubernetes.modelClaim); the embedded model is served with kubernetes.device: cpu"
            )
        return EMBEDDED_MODEL, k8s.served_model_name or EMBEDDED_NAME
    return spec.model, k8s.served_model_name or PurePosixPath(spec.model).name


def render(spec: FleetSpec, out: Path, manifests: Path | None = None) -> list[str]:
    """Write the overlay of `spec` into `out` (see the module docstring); returns notes."""
    manifests = manifests or find_manifests()
    k8s = spec.kubernetes
    model, served = _model(spec)
    if k8s.replica_resources is not None:
        check_memory(spec, k8s.replica_resources)
    notes: list[str] = []
    components = []
    if k8s.device == "cpu":
        components.append("cpu")
    download = not model.startswith("/")  # an HF id, downloaded into the model-cache volume
    hub = k8s.hub_egress if k8s.hub_egress is not None else download
    if hub:
        components.append("hub-egress")
    volume = l2_volume(spec)
    valkey_inside = spec.cache.l2_enabled and spec.cache.l2.kind == "valkey"
    if volume in ("curvine", "juicefs"):
        components.append(f"l2-{volume}")
    elif volume == "existingClaim":
        components.append("l2-existing-claim")
    elif volume is None and valkey_inside and spec.cache.l2.url is None:
        components.append("valkey")
    elif volume is None:
        components.append("no-l2")
    if download:
        components.append(MODEL_CACHE)
    if k8s.service_monitor:
        components.append("servicemonitor")
    rendered = rendered_env(spec, download, "valkey" in components)
    check_env("replicaEnv", k8s.replica_env, rendered, connector=True)
    check_env("routerEnv", k8s.router_env, rendered_router_env())
    replica_command = replica_args(spec)  # refused before --out is touched

    with replacing(out) as build:
        shutil.copytree(manifests / "base", build / "base")
        for name in dict.fromkeys([*components, "no-l2"] if "valkey" in components else components):
            shutil.copytree(manifests / "components" / name, build / "components" / name)
        (build / "patches").mkdir()
        _write_fleet_component(build, connector_env(spec), model, served)

        secret_files = [f"keys={secret(out, build, 'router-api-keys', 'key')}"]
        secret_files.append(f"tenant-salt-key={secret(out, build, 'tenant-salt-key', 'raw')}")
        generators: list[dict[str, Any]] = [
            {"name": "kvtier-router-api-keys", "files": secret_files},
        ]
        patches: list[dict[str, Any]] = []
        resources: list[str] = ["base"]

        replica = container_patch("kvtier-replica", "vllm", k8s.image or IMAGES[k8s.device])
        container = replica["spec"]["template"]["spec"]["containers"][0]
        container["args"] = replica_command
        env: Env = dict(k8s.replica_env)
        if k8s.device == "cpu":
            env.update(
                VLLM_CPU_KVCACHE_SPACE=str(spec.local.engine_kv_cache_gib),
                OMP_NUM_THREADS=str(spec.local.threads_per_replica),
            )
        elif spec.local.engine_kv_cache_gib != 1:
            notes.append("kvtier.engineKvCacheGiB: GPU engines size their cache by memory share")
        entries = env_entries(env)
        if k8s.fleet_name is not None and "valkey" in components:
            entries[:0] = valkey_env(spec)
        if entries:
            container["env"] = entries
        ephemeral = {"ephemeral-storage": f"{k8s.model_cache_gib}Gi"} if download else {}
        if k8s.replica_resources is not None:
            container["resources"] = resources_block(
                k8s.replica_resources, gpu=k8s.device == "gpu", requests=ephemeral
            )
        else:
            memory = f"{replica_memory_gib(spec)}Gi"
            requests = {"memory": memory, **ephemeral}
            if k8s.device == "cpu" and spec.local.threads_per_replica > 1:
                requests["cpu"] = str(spec.local.threads_per_replica)
            container["resources"] = {"requests": requests, "limits": {"memory": memory}}
        if download:
            cache = {"sizeLimit": f"{k8s.model_cache_gib}Gi"}
            volumes(replica).append({"name": MODEL_CACHE, "emptyDir": cache})
        replica["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = replica_grace_s(spec)
        gpu_tolerations = [GPU_TOLERATION] if k8s.device == "gpu" else []
        schedule(
            replica,
            node_selector=k8s.node_selector,
            tolerations=[*gpu_tolerations, *k8s.replica_tolerations],
            affinity=k8s.replica_affinity,
            priority_class=k8s.replica_priority_class_name,
            labels=k8s.replica_pod_labels,
            annotations=k8s.replica_pod_annotations,
        )
        router = container_patch("kvtier-router", "router", k8s.router_image)
        router_container = router["spec"]["template"]["spec"]["containers"][0]
        router_container["args"] = router_args(spec)
        if k8s.router_env:
            router_container["env"] = env_entries(k8s.router_env)
        router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = router_grace_s(spec)
        if k8s.router_resources is not None:
            router_container["resources"] = resources_block(k8s.router_resources, gpu=False)
        schedule(
            router,
            node_selector=k8s.router_node_selector,
            tolerations=k8s.router_tolerations,
            affinity=k8s.router_affinity,
            priority_class=k8s.router_priority_class_name,
            labels=k8s.router_pod_labels,
            annotations=k8s.router_pod_annotations,
        )
        if k8s.model_claim is not None:
            for patch in (replica, router):
                mount_model(patch, k8s.model_claim, k8s.model_mount_path)
        if volume == "existingClaim":
            l2_claim = {"claimName": k8s.l2_claim_name}
            volumes(replica).append({"name": "l2", "persistentVolumeClaim": l2_claim})
        _write(build / "patches" / "replica.yaml", replica)
        _write(build / "patches" / "router.yaml", router)
        patches += [{"path": "patches/replica.yaml"}, {"path": "patches/router.yaml"}]

        patches += volume_patches(spec, volume)
        if "valkey" in components:
            password = secret(out, build, "valkey-password", "raw")
            generators.append({"name": "kvtier-valkey", "files": [f"password={password}"]})
            _write(build / "patches" / "valkey.yaml", valkey_patch(spec))
            patches.append({"path": "patches/valkey.yaml"})
        if k8s.image_pull_secrets:
            pull = [{"name": name} for name in k8s.image_pull_secrets]
            add = [{"op": "add", "path": "/spec/template/spec/imagePullSecrets", "value": pull}]
            workloads = {"kind": "Deployment|StatefulSet"}  # replicas, routers, Valkey
            patches.append({"target": workloads, "patch": yaml.safe_dump(add)})
        if k8s.service_monitor_labels:
            labels = {"metadata": {"labels": dict(k8s.service_monitor_labels)}}
            patches.append(inline("ServiceMonitor", "kvtier", labels))
        url = spec.cache.l2.url
        if valkey_inside and url is not None:
            policy = external_valkey_policy(url, k8s.fleet_name)
            _write(build / "patches" / "l2-egress.yaml", policy)
            resources.append("patches/l2-egress.yaml")
            notes.append(
                "l2CacheLocalUrl: lands in a ConfigMap; a password in it is readable there"
            )

        if not k8s.creates_namespace:
            patches.append(DELETE_NAMESPACE)
        if k8s.fleet_name is not None:
            patches += fleet_selectors(build, k8s.fleet_name)

        kustomization: dict[str, Any] = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": k8s.namespace,
        }
        if k8s.fleet_name is not None:
            kustomization["namePrefix"] = f"{k8s.fleet_name}-"
        kustomization |= {
            "resources": resources,
            "components": [f"components/{name}" for name in [*components, FLEET_COMPONENT]],
            "labels": [
                {
                    "pairs": {INSTANCE_LABEL: k8s.fleet_name or k8s.instance},
                    "includeTemplates": True,
                }
            ],
            "replicas": [
                {"name": "kvtier-replica", "count": spec.replicas},
                {"name": "kvtier-router", "count": k8s.routers},
            ],
            "secretGenerator": generators,
            "patches": patches,
        }
        (build / "kustomization.yaml").write_text(
            HEADER + yaml.safe_dump(kustomization, sort_keys=False)
        )
    return notes


def _write_fleet_component(out: Path, env: dict[str, str], model: str, served: str) -> None:
    """The last component: the connector's and the model's ConfigMaps as the file sets them."""
    generators = [
        {"name": "kvtier-connector", "literals": [f"{k}={v}" for k, v in env.items()]},
        {"name": "kvtier-model", "literals": [f"MODEL={model}", f"SERVED_MODEL_NAME={served}"]},
    ]
    component = {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "configMapGenerator": [{**g, "behavior": "replace"} for g in generators],
    }
    path = out / "components" / FLEET_COMPONENT
    path.mkdir(parents=True)
    _write(path / "kustomization.yaml", component)


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
