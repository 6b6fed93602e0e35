"""The Kubernetes overlay of a deployment file: `kvtier deploy render --config F --out DIR`.

The manifests live in `deploy/k8s` (a kustomize base, and one component per option). Rendering
copies the base and the components the file asks for into DIR and writes DIR/kustomization.yaml
with what the file sets: replica and router counts, images, the router's flags, resources, the
L2 volume or Valkey, and generated secrets (the router's API key, Valkey's password) that a later
render keeps; the connector's settings (the `KVTIER_*` environment of the replicas) and the
model go in a last component, DIR/components/fleet. `kubectl apply -k DIR` deploys it; DIR holds
no reference to this checkout. DIR is new, empty, or an earlier render's (nothing else is
overwritten); the overlay is written beside the old one and replaces it only once it is whole.
A named fleet (`kubernetes.fleetName`) gets a namePrefix, and its name as one more label in
every selector of kvtier's pods, so that fleets share a namespace (`object_name`).

    spec = load_spec(Path("fleet.yaml"))
    notes = render(spec, Path("out"))       # notes: what the file set that has no effect here

The container command lines are built here once (`replica_args`, `router_args`) and the base
holds the ones of a default file; a test keeps the two equal.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from kvtier.core.errors import ConfigError
from kvtier.core.settings import to_flags
from kvtier.router.settings import RouterSettings
from kvtier.tools.cluster.spec import CONNECTOR_KEYS_SET_BY_THE_FLEET, GIB, FleetSpec
from kvtier.tools.deploy.settings import Affinity, Env, Resources, Toleration
from kvtier.tools.l2ops.valkey_server import PERSISTENT_L2_APPENDFSYNC
from kvtier.tools.router_cli import FLAGS as ROUTER_FLAGS
from kvtier.tools.vllm_server import STOP_GRACE_S
from kvtier.vllm.settings import ENV_PREFIX, ConnectorSettings, kv_transfer_config

__all__ = [
    "EMBEDDED_MODEL",
    "connector_env",
    "find_manifests",
    "object_name",
    "render",
    "replica_args",
    "replica_grace_s",
    "replica_memory_gib",
    "router_grace_s",
    "router_args",
    "valkey_memory_gib",
    "vllm_events",
]

HTTP_PORT = 8000
EVENTS_PORT = 5557
VLLM_EVENTS_PORT = 5558
"""vLLM's own KV-event publisher on a replica (`kubernetes.vllmKvEvents`)."""
L2_MOUNT = "/mnt/kvtier-l2"
API_KEYS_FILE = "/etc/kvtier/api-keys/keys"
EMBEDDED_MODEL = "/opt/kvtier/model"
"""Where the CPU image (deploy/docker/Dockerfile.cpu) keeps the embedded model."""
VALKEY_OVERHEAD = 1.25
"""The in-cluster Valkey's resident memory per byte of data at `maxmemory` (the allocator's
fragmentation, per-key structures), plus `VALKEY_BASE_GIB` for the server itself."""
VALKEY_BASE_GIB = 0.5
VALKEY_DATA = "/data"
"""Where a persistent in-cluster Valkey keeps its append-only file (its claim's mount)."""
EMBEDDED_NAME = "SmolLM2-135M-Instruct-bf16"
IMAGES = {"gpu": "kvtier/vllm-gpu:0.2.0", "cpu": "kvtier/vllm-cpu:0.2.0"}
GPU = "nvidia.com/gpu"
GPU_TOLERATION = Toleration(key=GPU, operator="Exists", effect="NoSchedule")
"""Tolerated by GPU replicas (deploy/k8s/base/replicas.yaml): the taint of GPU nodes on EKS
(Karpenter, GPU node groups) and GKE."""
SHM_GIB = 2
"""The replicas' memory-backed /dev/shm (deploy/k8s/base/replicas.yaml): its pages count against
the container's memory limit."""
ENGINE_MEMORY_GIB = {"gpu": 26, "cpu": 2}
"""A replica's host memory for vLLM itself (processes, CUDA, weights on CPU), by device."""
MIN_ENGINE_MEMORY_GIB = {"gpu": 8, "cpu": 1}
"""The least of it a `replicaResources` memory limit may leave."""
MODEL_CACHE = "model-cache"
"""The replicas' download cache volume (deploy/k8s/components/model-cache)."""
_QUANTITY_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_QUANTITY_UNITS |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "8192"]
REPLICA_PRESTOP_S = 20
"""The replica's preStop sleep (deploy/k8s/base/replicas.yaml): the pod leaves the Service and
the routers stop sending to it before vLLM gets SIGTERM."""
ROUTER_PRESTOP_S = 10
"""The router's preStop sleep (deploy/k8s/base/router.yaml): the Service stops sending to it."""
ROUTER_EXIT_S = 10
"""Left to the router, after its drain, to exit before the kubelet kills it."""
HEADER = "# Written by `kvtier deploy render`; apply with: kubectl apply -k .\n"
"""The first line of a rendered kustomization.yaml: marks a directory `render` may rewrite."""
NAME_LABEL = "app.kubernetes.io/name"
"""Selects kvtier's pods (with `app.kubernetes.io/component`) in every selector of the base."""
INSTANCE_LABEL = "app.kubernetes.io/instance"
"""Selects a named fleet's pods (`kubernetes.fleetName`) besides `NAME_LABEL`."""
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


def object_name(spec: FleetSpec, name: str) -> str:
    """The fleet's object of the base's `name` (kvtier-replicas): prefixed by
    `kubernetes.fleetName`, as the overlay's namePrefix renames it."""
    fleet = spec.kubernetes.fleet_name
    return name if fleet is None else f"{fleet}-{name}"


# ----- container command lines --------------------------------------------------------------


def _transfer_config() -> str:
    """`--kv-transfer-config`: the connector, its settings coming from the environment."""
    config = kv_transfer_config(ConnectorSettings())
    config.pop("kv_connector_extra_config")
    return json.dumps(config)


def vllm_events(spec: FleetSpec) -> bool:
    """Whether the replicas publish vLLM's own KV events and the routers follow them: only the
    kvaware strategy reads them."""
    return spec.kubernetes.vllm_kv_events and spec.strategy == "kvaware"


def _events_config() -> str:
    """`--kv-events-config`: vLLM's KV events published on every address of the pod."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{VLLM_EVENTS_PORT}",
    }
    return json.dumps(config)


def replica_args(spec: FleetSpec) -> list[str]:
    """`vllm serve` arguments of a replica (the model and names come from its environment)."""
    args = ["$(MODEL)", "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    args += ["--served-model-name", "$(SERVED_MODEL_NAME)", "--enable-prompt-tokens-details"]
    args += ["--shutdown-timeout", str(spec.local.replica_drain_s)]
    if spec.cache.connector_enabled:
        args += ["--kv-transfer-config", _transfer_config()]
    if vllm_events(spec):
        if any(a.split("=")[0] == "--kv-events-config" for a in spec.kubernetes.vllm_args):
            raise ConfigError(
                "kubernetes.vllmArgs: --kv-events-config is set by kubernetes.vllmKvEvents "
                "(the routers follow it); set vllmKvEvents: false to give your own"
            )
        args += ["--kv-events-config", _events_config()]
    if spec.kubernetes.device == "cpu":
        args += CPU_ARGS
    if spec.local.engine_kv_cache_blocks is not None:
        args += ["--num-gpu-blocks-override", str(spec.local.engine_kv_cache_blocks)]
    if spec.local.engine_dtype != "auto":
        args += ["--dtype", spec.local.engine_dtype]
    return args + list(spec.kubernetes.vllm_args)


def replica_grace_s(spec: FleetSpec) -> int:
    """The replica pod's terminationGracePeriodSeconds: preStop, drain, and the engine's exit
    (`STOP_GRACE_S`: its teardown and the connector's last L2 writes)."""
    return REPLICA_PRESTOP_S + spec.local.replica_drain_s + int(STOP_GRACE_S)


def replica_memory_gib(spec: FleetSpec, engine_gib: float | None = None) -> int:
    """A replica's host memory in whole GiB: `engine_gib` for vLLM (`ENGINE_MEMORY_GIB` of the
    device by default), its L1, the memory-backed /dev/shm, and on CPU the engine's KV cache."""
    device = spec.kubernetes.device
    gib = ENGINE_MEMORY_GIB[device] if engine_gib is None else engine_gib
    gib += SHM_GIB + (spec.cache.l1_gib if spec.cache.l1_enabled else 0)
    if device == "cpu":
        gib += spec.local.engine_kv_cache_gib
    return math.ceil(gib)


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


def router_grace_s(spec: FleetSpec) -> int:
    """The router pod's terminationGracePeriodSeconds: preStop, drain (`drain_s`), exit."""
    return ROUTER_PRESTOP_S + spec.router_drain_s + ROUTER_EXIT_S


def router_args(spec: FleetSpec) -> list[str]:
    """`kvtier router` arguments: replicas by the headless Service, events on their ports."""
    values: dict[str, Any] = {
        "strategy": spec.strategy,
        "host": "0.0.0.0",
        "port": HTTP_PORT,
        "model_dir": "$(MODEL)",
        "replicas_dns": f"{object_name(spec, 'kvtier-replicas')}:{HTTP_PORT}",
        "discovery_interval_s": 5,
        "replica_events_port": EVENTS_PORT if spec.cache.connector_enabled else None,
        "replica_vllm_events_port": VLLM_EVENTS_PORT if vllm_events(spec) else None,
        "consistent_ties": True,
        "api_keys_file": API_KEYS_FILE,
    }
    values.update(spec.local.router)
    RouterSettings.from_mapping(values, where="kvtier.router")  # a bad value fails here
    return to_flags(RouterSettings, values, ROUTER_FLAGS)


def connector_env(spec: FleetSpec) -> dict[str, str]:
    """The replicas' `KVTIER_*` connector settings (their own id is set per pod)."""
    settings = spec.connector_settings(
        replica_id="per-pod",
        events_endpoint=f"tcp://0.0.0.0:{EVENTS_PORT}",
        l2_location=None,
    )
    if settings is None:
        return {}
    values = settings.non_default()
    values.pop("replica_id")
    l2 = spec.cache.l2
    if spec.cache.l2_enabled and l2.kind != "valkey":
        values.update(
            l2_path=L2_MOUNT,
            l2_capacity_bytes=int(l2.size_gib * GIB),
            l2_profile=_file_system(spec),
        )
    elif spec.cache.l2_enabled and l2.url is not None:
        values["l2_url"] = l2.url  # an in-cluster Valkey's URL carries a Secret: set per pod
    env = {ENV_PREFIX + k.upper(): _env_value(k, v) for k, v in values.items()}
    _check_round_trip(values, env)
    return env


def _rendered_env(spec: FleetSpec, download: bool, valkey_inside: bool) -> dict[str, str]:
    """The replicas' variables other than `KVTIER_*` that the overlay sets -> the key of the
    file that sets them, or "(why)": a `replicaEnv` entry would replace them (`env` wins over
    the ConfigMaps' `envFrom`, and a patch's entry over the base's)."""
    owners = {
        "POD_IP": "(the pod's IP: KVTIER_REPLICA_ID is made of it)",
        "MODEL": "model",
        "SERVED_MODEL_NAME": "kubernetes.servedModelName",
    }
    if download:
        owners["HF_HOME"] = "(the model download cache's mount; its size: kubernetes.modelCacheGiB)"
    if spec.kubernetes.device == "cpu":
        owners["VLLM_CPU_KVCACHE_SPACE"] = "kvtier.engineKvCacheGiB"
        owners["OMP_NUM_THREADS"] = "kvtier.threadsPerReplica"
    if valkey_inside:
        owners["VALKEY_PASSWORD"] = "(the in-cluster Valkey's generated Secret)"
    return owners


_CONNECTOR_OWNERS = {
    **CONNECTOR_KEYS_SET_BY_THE_FLEET,
    "replica_id": "(each pod's URL, as the routers name it)",
    "events_endpoint": f"(port {EVENTS_PORT}, which the routers follow)",
}


def _rendered_router_env() -> dict[str, str]:
    """The routers' variables that the overlay sets, as `_rendered_env` the replicas'."""
    return {
        "MODEL": "model",
        "SERVED_MODEL_NAME": "kubernetes.servedModelName",
        "HOME": "(the routers' writable home, an emptyDir: their UID is unknown to the image)",
        "KVTIER_TENANT_SALT_KEY": "(the tenant salt, the same on every router: a generated "
        "Secret's, kept in OUT/secrets/tenant-salt-key)",
    }


def _check_env(key: str, env: Env, rendered: dict[str, str], connector: bool = False) -> None:
    """A `ConfigError` naming the first entry of `env` (the file's `kubernetes.KEY`) that
    would override what the overlay sets on that container: one of `rendered`, or with
    `connector` a connector setting (the connector reads `KVTIER_<KEY>`; the file's are
    checked when rendering and some are derived from other keys)."""
    fields = ConnectorSettings.model_fields if connector else {}
    settings = {ENV_PREFIX + name.upper(): name for name in fields}
    for name in env:
        where = f"kubernetes.{key}.{name}"
        setting = settings.get(name)
        if setting is not None and setting not in _CONNECTOR_OWNERS:
            raise ConfigError(
                f"{where}: a connector setting; give it as kvtier.connector.{setting} (checked "
                "when rendering, and kept in the kvtier-connector ConfigMap)"
            )
        owner = _CONNECTOR_OWNERS[setting] if setting is not None else rendered.get(name)
        if owner is not None and owner.startswith("("):
            raise ConfigError(f"{where}: the overlay sets it {owner}")
        if owner is not None:
            raise ConfigError(f"{where}: the overlay sets it from {owner}; set that instead")


def _env_value(name: str, value: object) -> str:
    """`value` of the setting `name` as the replicas' `from_sources` reads it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)  # file permissions are dumped as octal strings already


def _check_round_trip(values: dict[str, Any], env: dict[str, str]) -> None:
    """Raise unless the replicas, parsing `env`, get `values`."""
    parsed = ConnectorSettings.from_sources({}, env).model_dump()
    changed = sorted(k for k, v in values.items() if parsed[k] != v)
    if changed:
        raise ConfigError(f"kvtier.connector: {', '.join(changed)} would not reach the replicas")


def _l2_volume(spec: FleetSpec) -> str | None:
    """claim | curvine | juicefs | existingClaim; None: no volume (no L2, or Valkey)."""
    if not spec.cache.l2_enabled or spec.cache.l2.kind == "valkey":
        return None
    chosen = spec.kubernetes.l2_volume
    if spec.cache.l2.kind == "juicefs":
        if chosen not in (None, "juicefs"):
            raise ConfigError(
                f"kubernetes.l2Volume: {chosen} does not go with l2CacheBackend juicefs"
            )
        return "juicefs"
    return chosen or "claim"


def _file_system(spec: FleetSpec) -> str:
    volume = _l2_volume(spec)
    default = volume if volume in ("curvine", "juicefs") else "nfs"
    return spec.kubernetes.l2_file_system or default


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


# ----- the overlay --------------------------------------------------------------------------


def render(spec: FleetSpec, out: Path, manifests: Path | None = None) -> list[str]:
    """Write the overlay of `spec` into `out` (see the module docstring); returns notes."""
    manifests = manifests or find_manifests()
    k8s = spec.kubernetes
    model, served = _model(spec)
    if k8s.replica_resources is not None:
        _check_memory(spec, k8s.replica_resources)
    notes: list[str] = []
    components = []
    if k8s.device == "cpu":
        components.append("cpu")
    download = not model.startswith("/")  # an HF id, downloaded into the model-cache volume
    hub = k8s.hub_egress if k8s.hub_egress is not None else download
    if hub:
        components.append("hub-egress")
    volume = _l2_volume(spec)
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
    rendered = _rendered_env(spec, download, "valkey" in components)
    _check_env("replicaEnv", k8s.replica_env, rendered, connector=True)
    _check_env("routerEnv", k8s.router_env, _rendered_router_env())
    replica_command = replica_args(spec)  # refused before --out is touched

    with _replacing(out) as build:
        shutil.copytree(manifests / "base", build / "base")
        for name in dict.fromkeys([*components, "no-l2"] if "valkey" in components else components):
            shutil.copytree(manifests / "components" / name, build / "components" / name)
        (build / "patches").mkdir()
        _write_fleet_component(build, connector_env(spec), model, served)

        secret_files = [f"keys={_secret(out, build, 'router-api-keys', 'key')}"]
        secret_files.append(f"tenant-salt-key={_secret(out, build, 'tenant-salt-key', 'raw')}")
        generators: list[dict[str, Any]] = [
            {"name": "kvtier-router-api-keys", "files": secret_files},
        ]
        patches: list[dict[str, Any]] = []
        resources: list[str] = ["base"]

        replica = _container_patch("kvtier-replica", "vllm", k8s.image or IMAGES[k8s.device])
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
        entries = _env(env)
        if k8s.fleet_name is not None and "valkey" in components:
            entries[:0] = _valkey_env(spec)
        if entries:
            container["env"] = entries
        ephemeral = {"ephemeral-storage": f"{k8s.model_cache_gib}Gi"} if download else {}
        if k8s.replica_resources is not None:
            container["resources"] = _resources(
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
            _volumes(replica).append({"name": MODEL_CACHE, "emptyDir": cache})
        replica["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = replica_grace_s(spec)
        gpu_tolerations = [GPU_TOLERATION] if k8s.device == "gpu" else []
        _schedule(
            replica,
            node_selector=k8s.node_selector,
            tolerations=[*gpu_tolerations, *k8s.replica_tolerations],
            affinity=k8s.replica_affinity,
            priority_class=k8s.replica_priority_class_name,
            labels=k8s.replica_pod_labels,
            annotations=k8s.replica_pod_annotations,
        )
        router = _container_patch("kvtier-router", "router", k8s.router_image)
        router_container = router["spec"]["template"]["spec"]["containers"][0]
        router_container["args"] = router_args(spec)
        if k8s.router_env:
            router_container["env"] = _env(k8s.router_env)
        router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = router_grace_s(spec)
        if k8s.router_resources is not None:
            router_container["resources"] = _resources(k8s.router_resources, gpu=False)
        _schedule(
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
                _mount_model(patch, k8s.model_claim, k8s.model_mount_path)
        if volume == "existingClaim":
            l2_claim = {"claimName": k8s.l2_claim_name}
            _volumes(replica).append({"name": "l2", "persistentVolumeClaim": l2_claim})
        _write(build / "patches" / "replica.yaml", replica)
        _write(build / "patches" / "router.yaml", router)
        patches += [{"path": "patches/replica.yaml"}, {"path": "patches/router.yaml"}]

        l2 = spec.cache.l2
        if volume is not None and volume != "existingClaim":
            claim = {"spec": _claim_spec(spec, l2.size_gib * 1.25)}
            patches.append(_inline("PersistentVolumeClaim", "kvtier-l2", claim))
        if volume == "curvine":
            parameters = {"master-addrs": k8s.curvine_master_addrs}
            patches.append(_inline("StorageClass", "kvtier-curvine", {"parameters": parameters}))
        if volume == "juicefs":
            parameters = {
                f"csi.storage.k8s.io/{role}-secret-namespace": k8s.namespace
                for role in ("provisioner", "node-publish")
            }
            patches.append(_inline("StorageClass", "kvtier-juicefs", {"parameters": parameters}))
        if "valkey" in components:
            password = _secret(out, build, "valkey-password", "raw")
            generators.append({"name": "kvtier-valkey", "files": [f"password={password}"]})
            patches.append(_valkey_patch(build, spec))
        if k8s.image_pull_secrets:
            pull = [{"name": name} for name in k8s.image_pull_secrets]
            add = [{"op": "add", "path": "/spec/template/spec/imagePullSecrets", "value": pull}]
            workloads = {"kind": "Deployment|StatefulSet"}  # replicas, routers, Valkey
            patches.append({"target": workloads, "patch": yaml.safe_dump(add)})
        if k8s.service_monitor_labels:
            labels = {"metadata": {"labels": dict(k8s.service_monitor_labels)}}
            patches.append(_inline("ServiceMonitor", "kvtier", labels))
        if valkey_inside and l2.url is not None:
            resources.append(_external_valkey_policy(build, l2.url, k8s.fleet_name))
            notes.append(
                "l2CacheLocalUrl: lands in a ConfigMap; a password in it is readable there"
            )

        if not k8s.creates_namespace:
            patches.append(_DELETE_NAMESPACE)
        if k8s.fleet_name is not None:
            patches += _fleet_selectors(build, k8s.fleet_name)

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


OVERLAY = ("base", "components", "patches", "kustomization.yaml")
"""What `render` writes into --out and replaces there (secrets/ is kept, other files left)."""
SECRETS = "secrets"
"""Where --out keeps the generated secrets: a render adds the ones it lacks, never replaces."""


@contextlib.contextmanager
def _replacing(out: Path) -> Iterator[Path]:
    """A new directory in `out` to write the overlay (and new secrets) into; once it is
    written, the new secrets join `out`'s, its entries replace those of `out` (an earlier
    render's) and it is removed. Until then `out` is left as it was, so a render that fails
    loses nothing and leaves nothing (an `out` it made is removed again: a later render must
    not find it non-empty). An `OSError` is a `ConfigError` naming --out."""
    made = not out.exists()
    try:
        _claim_out_dir(out)
        build = Path(tempfile.mkdtemp(prefix=".render.", dir=out))
        try:
            yield build
            if (build / SECRETS).is_dir():
                (out / SECRETS).mkdir(mode=0o700, exist_ok=True)
                for secret in (build / SECRETS).iterdir():
                    secret.rename(out / SECRETS / secret.name)
            old = build / "old"
            old.mkdir()
            for name in OVERLAY:  # kustomization.yaml last: the overlay is whole once it is
                with contextlib.suppress(FileNotFoundError):
                    (out / name).rename(old / name)
                (build / name).rename(out / name)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    except BaseException as exc:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(exc, OSError):
            raise ConfigError(f"--out {out}: {exc.strerror or exc}") from None
        raise


def _claim_out_dir(out: Path) -> None:
    """Make `out`; a `ConfigError` if it is a file, or a non-empty directory whose
    kustomization.yaml `render` did not write (re-rendering would overwrite the user's files)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: not a directory")
    if out.is_dir() and any(out.iterdir()) and not _written_by_render(out):
        raise ConfigError(
            f"--out {out}: a non-empty directory `kvtier deploy render` did not write; "
            "give a new or empty one"
        )
    out.mkdir(parents=True, exist_ok=True)


def _written_by_render(out: Path) -> bool:
    try:
        return (out / "kustomization.yaml").read_bytes().startswith(HEADER.encode())
    except OSError:
        return False


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


def _container_patch(deployment: str, container: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment},
        "spec": {"template": {"spec": {"containers": [{"name": container, "image": image}]}}},
    }


def _env(env: Env) -> list[dict[str, Any]]:
    """A container's `env` entries (merged by name into the base's)."""
    return [
        {"name": k, "value": v}
        if isinstance(v, str)
        else {"name": k, "valueFrom": v.model_dump(by_alias=True)}
        for k, v in env.items()
    ]


def _resources(
    resources: Resources, gpu: bool, requests: dict[str, str] | None = None
) -> dict[str, Any]:
    """`resources` in place of the base's whole block, with `requests` they do not give; with
    `gpu`, one GPU unless they give a count (Kubernetes takes it as a limit: `Resources` copies
    a request there)."""
    dumped = resources.model_dump()
    dumped["requests"] = {**(requests or {}), **dumped["requests"]}
    if gpu:
        dumped["limits"].setdefault(GPU, "1")
    return {"$patch": "replace", **dumped}


def _check_memory(spec: FleetSpec, resources: Resources) -> None:
    """A `ConfigError` if `resources` limit the replicas' memory below their L1, /dev/shm (and
    on CPU the engine's KV cache) with the least memory vLLM runs in: an OOM kill once warm."""
    limit = resources.limits.get("memory")
    device = spec.kubernetes.device
    needed = replica_memory_gib(spec, MIN_ENGINE_MEMORY_GIB[device])
    if limit is None or _gib(limit) >= needed:
        return
    l1 = spec.cache.l1_gib if spec.cache.l1_enabled else 0
    engine_kv = f" + kvtier.engineKvCacheGiB ({spec.local.engine_kv_cache_gib})"
    raise ConfigError(
        f"kubernetes.replicaResources.limits.memory: {limit} is below kvCacheSpec.l1CacheSizeGiB "
        f"({l1:g}) + /dev/shm ({SHM_GIB}){engine_kv if device == 'cpu' else ''} + "
        f"{MIN_ENGINE_MEMORY_GIB[device]} for vLLM = {needed}Gi: raise the limit or lower the L1"
    )


def _gib(quantity: str) -> float:
    """A Kubernetes quantity ("30Gi", "32G", "500m") in GiB."""
    number = quantity.rstrip("mkMGTi")
    return float(number) * _QUANTITY_UNITS[quantity[len(number) :]] / GIB


def _schedule(
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


def _volumes(patch: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's volumes in a Deployment patch (merged by name into the base's)."""
    volumes: list[dict[str, Any]] = patch["spec"]["template"]["spec"].setdefault("volumes", [])
    return volumes


def _mount_model(patch: dict[str, Any], claim: str, path: str) -> None:
    container = patch["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [{"name": "model", "mountPath": path, "readOnly": True}]
    _volumes(patch).append({"name": "model", "persistentVolumeClaim": {"claimName": claim}})


def _inline(kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    version = {
        "StorageClass": "storage.k8s.io/v1",
        "ServiceMonitor": "monitoring.coreos.com/v1",
    }.get(kind, "v1")
    metadata = {"name": name, **body.get("metadata", {})}
    doc = {"apiVersion": version, "kind": kind, **body, "metadata": metadata}
    return {"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(doc)}


def _valkey_patch(out: Path, spec: FleetSpec) -> dict[str, Any]:
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
    patch = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "kvtier-valkey"},
        "spec": statefulset,
    }
    _write(out / "patches" / "valkey.yaml", patch)
    return {"path": "patches/valkey.yaml"}


def _claim_spec(spec: FleetSpec, default_gib: float) -> dict[str, Any]:
    """A new claim's size (`l2ClaimGiB`, else `default_gib` rounded up) and class."""
    k8s = spec.kubernetes
    size = k8s.l2_claim_gib or math.ceil(default_gib)
    claim: dict[str, Any] = {"resources": {"requests": {"storage": f"{size}Gi"}}}
    if k8s.l2_storage_class is not None:
        claim["storageClassName"] = k8s.l2_storage_class
    return claim


def _valkey_claim(spec: FleetSpec) -> dict[str, Any]:
    """The persistent Valkey's own ReadWriteOnce claim: room for its append-only file, which
    grows to twice the data between rewrites and briefly holds a third copy during one."""
    return {
        "metadata": {"name": "data"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            **_claim_spec(spec, spec.cache.l2.size_gib * 3 + 1),
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


def _external_valkey_policy(out: Path, url: str, fleet: str | None) -> str:
    """Replicas may reach the external Valkey's port (its address is outside the cluster)."""
    from urllib.parse import urlsplit

    port = urlsplit(url).port or 6379
    replicas = {NAME_LABEL: "kvtier", "app.kubernetes.io/component": "replica"}
    if fleet is not None:
        replicas[INSTANCE_LABEL] = fleet
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "kvtier-replica-to-l2"},
        "spec": {
            "podSelector": {"matchLabels": replicas},
            "policyTypes": ["Egress"],
            "egress": [{"ports": [{"protocol": "TCP", "port": port}]}],
        },
    }
    _write(out / "patches" / "l2-egress.yaml", policy)
    return "patches/l2-egress.yaml"


_DELETE_NAMESPACE = {
    "target": {"kind": "Namespace"},
    "patch": yaml.safe_dump(
        {"$patch": "delete", "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}
    ),
}
"""Leaves the base's Namespace out (`kubernetes.createNamespace`)."""


def _valkey_env(spec: FleetSpec) -> list[dict[str, Any]]:
    """The in-cluster Valkey's URL naming the fleet's Service (components/valkey names the
    lone fleet's), after the password it expands: a patch's entries come first in the merged
    list, and `$(VAR)` expands only a variable defined above it."""
    host = object_name(spec, "kvtier-valkey")
    password = {"secretKeyRef": {"name": "kvtier-valkey", "key": "password"}}
    return [
        {"name": "VALKEY_PASSWORD", "valueFrom": password},
        {"name": "KVTIER_L2_URL", "value": f"redis://:$(VALKEY_PASSWORD)@{host}:6379/0"},
    ]


def _fleet_selectors(build: Path, fleet: str) -> list[dict[str, Any]]:
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


def _secret(out: Path, build: Path, name: str, kind: str) -> str:
    """A random secret kept in out/secrets (made once, in `build` until the overlay is whole;
    re-rendering keeps it)."""
    if not (out / SECRETS / name).exists():
        path = build / SECRETS / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(24) + ("\n" if kind == "key" else ""))
    return f"{SECRETS}/{name}"


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
