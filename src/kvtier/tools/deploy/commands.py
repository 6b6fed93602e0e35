"""The containers' command lines and grace periods, built here once for the overlay.

`replica_args` (`vllm serve`) and `router_args` (`kvtier router`) are what the rendered
Deployments run; deploy/k8s/base holds the ones of a default file and a test keeps the two
equal. `replica_grace_s` and `router_grace_s` are the pods' terminationGracePeriodSeconds, made
of the base's preStop sleeps and the file's drains. The ports here are the ones the base's
containers and Services expose. Pure functions of the file: a bad setting is a `ConfigError`.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.settings import to_flags
from kvtier.router.settings import RouterSettings
from kvtier.tools.cluster.spec import FleetSpec
from kvtier.tools.deploy.fleet_name import object_name
from kvtier.tools.router_cli import FLAGS as ROUTER_FLAGS
from kvtier.tools.vllm_server import STOP_GRACE_S
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config

__all__ = [
    "EVENTS_PORT",
    "replica_args",
    "replica_grace_s",
    "router_args",
    "router_grace_s",
    "vllm_events",
]

HTTP_PORT = 8000
EVENTS_PORT = 5557
VLLM_EVENTS_PORT = 5558
"""vLLM's own KV-event publisher on a replica (`kubernetes.vllmKvEvents`)."""
VLLM_REPLAY_PORT = 5559
"""Where that publisher replays the events a router missed (vLLM's `replay_endpoint`)."""
API_KEYS_FILE = "/etc/kvtier/api-keys/keys"
CPU_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "8192"]
REPLICA_PRESTOP_S = 20
"""The replica's preStop sleep (deploy/k8s/base/replicas.yaml): the pod leaves the Service and
the routers stop sending to it before vLLM gets SIGTERM."""
ROUTER_PRESTOP_S = 10
"""The router's preStop sleep (deploy/k8s/base/router.yaml): the Service stops sending to it."""
ROUTER_EXIT_S = 10
"""Left to the router, after its drain, to exit before the kubelet kills it."""


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
    """`--kv-events-config`: vLLM's KV events published on every address of the pod, and
    replayed from there to a router that missed some."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{VLLM_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{VLLM_REPLAY_PORT}",
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
        "replica_vllm_replay_port": VLLM_REPLAY_PORT if vllm_events(spec) else None,
        "consistent_ties": True,
        "api_keys_file": API_KEYS_FILE,
    }
    values.update(spec.local.router)
    RouterSettings.from_mapping(values, where="kvtier.router")  # a bad value fails here
    return to_flags(RouterSettings, values, ROUTER_FLAGS)
