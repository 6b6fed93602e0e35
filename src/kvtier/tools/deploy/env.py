"""The containers' environment: the connector's settings, and what the file may not override.

`connector_env` turns the file's connector settings into the replicas' `KVTIER_*` variables
(the kvtier-connector ConfigMap) and refuses any the replicas would read back otherwise.
`check_env` refuses a `kubernetes.replicaEnv`/`routerEnv` entry that would replace a variable
the overlay sets (`rendered_env`, `rendered_router_env`): a container's `env` wins over its
ConfigMaps, so the file's value would silently win. Pure functions of the file: a refusal is a
`ConfigError` naming the key to set instead.
"""

from __future__ import annotations

from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.tools.cluster.spec import CONNECTOR_KEYS_SET_BY_THE_FLEET, GIB, FleetSpec
from kvtier.tools.deploy.commands import EVENTS_PORT
from kvtier.tools.deploy.l2_volume import L2_MOUNT, file_system
from kvtier.tools.deploy.settings import Env
from kvtier.vllm.settings import ENV_PREFIX, ConnectorSettings

__all__ = ["check_env", "connector_env", "rendered_env", "rendered_router_env"]


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
            l2_profile=file_system(spec),
        )
    elif spec.cache.l2_enabled and l2.url is not None:
        values["l2_url"] = l2.url  # an in-cluster Valkey's URL carries a Secret: set per pod
    env = {ENV_PREFIX + k.upper(): _env_value(k, v) for k, v in values.items()}
    _check_round_trip(values, env)
    return env


def rendered_env(spec: FleetSpec, download: bool, valkey_inside: bool) -> dict[str, str]:
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


def rendered_router_env() -> dict[str, str]:
    """The routers' variables that the overlay sets, as `rendered_env` the replicas'."""
    return {
        "MODEL": "model",
        "SERVED_MODEL_NAME": "kubernetes.servedModelName",
        "HOME": "(the routers' writable home, an emptyDir: their UID is unknown to the image)",
        "KVTIER_TENANT_SALT_KEY": "(the tenant salt, the same on every router: a generated "
        "Secret's, kept in OUT/secrets/tenant-salt-key)",
    }


def check_env(key: str, env: Env, rendered: dict[str, str], connector: bool = False) -> None:
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
