"""The connector's settings, read from vLLM's `kv_connector_extra_config` or the environment.

Called once per connector instance (scheduler and each worker) from `KvtierConnector.__init__`.
A key given in the extra config wins; otherwise the environment variable named beside each
field is used; otherwise the default. Unknown extra-config keys raise `ConfigError`, so a typo
never silently runs with defaults.

    {"kv_connector": "KvtierConnector",
     "kv_connector_module_path": "kvtier.vllm.connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"l1_bytes": 4294967296, "l2_path": "/mnt/kv"}}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier.core.settings import StoreConfig
from kvtier.core.errors import ConfigError

ENV_PREFIX = "KVTIER_"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Settings of one replica's connector (env var: `KVTIER_<FIELD NAME IN UPPER CASE>`)."""

    l1_bytes: int = 2 * 1024**3
    """L1 host-memory budget per TP rank in bytes; 0 disables L1 (KVTIER_L1_BYTES)."""
    l2_path: str | None = None
    """Shared L2 directory; unset disables L2 (KVTIER_L2_PATH)."""
    l2_url: str | None = None
    """Valkey/Redis L2 instead of a directory, e.g. redis://127.0.0.1:6379 (KVTIER_L2_URL)."""
    l2_capacity_bytes: int = 0
    """Cluster-wide capacity of a directory L2, enforced by the janitor; 0: unbounded
    (KVTIER_L2_CAPACITY_BYTES)."""
    l2_profile: str = "local"
    """File-system profile of a directory L2: local, juicefs, curvine, nfs, efs
    (KVTIER_L2_PROFILE)."""
    admission: str = "always"
    """Admission policy name of the store (KVTIER_ADMISSION)."""
    admission_min_tokens: int = 0
    """Prefix length a block needs for the "min-tokens" policy (KVTIER_ADMISSION_MIN_TOKENS)."""
    block_tokens: int = 128
    """Tokens per kvtier block; a multiple of the engine's block size (KVTIER_BLOCK_TOKENS).
    128 matches vLLM's CPU block: a hit never leaves a partly covered engine block to recompute,
    and 2.8 MiB objects (embedded model) are still large enough for FUSE and network I/O."""
    write_queue_blocks: int = 64
    """Bounded asynchronous L2 write queue, in blocks (KVTIER_WRITE_QUEUE_BLOCKS)."""
    io_threads: int = 2
    """Store threads doing L2 I/O (KVTIER_IO_THREADS)."""
    events_endpoint: str | None = None
    """ZMQ endpoint this replica's KV-event publisher binds, e.g. "tcp://127.0.0.1:5601";
    unset disables events (KVTIER_EVENTS_ENDPOINT)."""
    replica_id: str | None = None
    """Replica id carried by events; the router's name for this replica, usually its base URL.
    Default: "<hostname>:<pid>" (KVTIER_REPLICA_ID)."""
    model_id: str | None = None
    """Model name in the namespace; default: the model directory's name (KVTIER_MODEL_ID).
    Replicas that should share blocks need the same value and the same weights."""
    lookup_wait_ms: float = 2.0
    """How long the scheduler waits for a lookup it just started before answering "still
    looking" (None). Lookups in L1 and a local L2 finish well within it, so a hit is scheduled
    in the same step instead of a step later (a whole forward pass under load); a slow mount
    never delays the scheduler by more than this (KVTIER_LOOKUP_WAIT_MS)."""
    lookup_ttl_s: float = 1.0
    """How long a finished scheduler-side lookup answer is trusted (KVTIER_LOOKUP_TTL_S)."""
    load_threads: int = 1
    """Worker threads moving blocks from the store into vLLM's KV cache (KVTIER_LOAD_THREADS)."""
    load_async: bool = False
    """Load hits while the engine keeps stepping (the request waits in WAITING_FOR_REMOTE_KVS);
    False loads them inside the step that computes the rest of the prompt, before its forward
    pass: one step less for the hit, but that step's whole batch waits for the load
    (KVTIER_LOAD_ASYNC)."""

    def __post_init__(self) -> None:
        if self.l1_bytes < 0:
            raise ConfigError(f"l1_bytes: must be >= 0, got {self.l1_bytes}")
        if self.l2_path is not None and not self.l2_path:
            raise ConfigError("l2_path: must be unset or a non-empty path")
        if self.block_tokens <= 0:
            raise ConfigError(f"block_tokens: must be positive, got {self.block_tokens}")
        if self.events_endpoint is not None and "://" not in self.events_endpoint:
            raise ConfigError(
                f"events_endpoint: expected a ZMQ endpoint like tcp://127.0.0.1:5601, "
                f"got {self.events_endpoint!r}")
        if self.lookup_wait_ms < 0:
            raise ConfigError(f"lookup_wait_ms: must be >= 0, got {self.lookup_wait_ms}")
        if self.lookup_ttl_s < 0:
            raise ConfigError(f"lookup_ttl_s: must be >= 0, got {self.lookup_ttl_s}")
        if self.load_threads <= 0:
            raise ConfigError(f"load_threads: must be positive, got {self.load_threads}")
        self.store_config()  # validates the store's share of the settings

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any] | None,
                     environ: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Extra-config keys first, then `KVTIER_*` environment variables, then defaults."""
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown kvtier connector setting "
                              f"(known: {', '.join(sorted(known))})")
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in extra:
                raw, source = extra[name], name
            elif ENV_PREFIX + name.upper() in environ:
                raw, source = environ[ENV_PREFIX + name.upper()], ENV_PREFIX + name.upper()
            else:
                continue
            values[name] = _coerce(source, raw, f.default)
        return cls(**values)

    def store_config(self) -> StoreConfig:
        return StoreConfig(l1_bytes=self.l1_bytes, l2_path=self.l2_path, l2_url=self.l2_url,
                           l2_capacity_bytes=self.l2_capacity_bytes or None,
                           l2_profile=self.l2_profile,
                           admission=self.admission,
                           admission_min_tokens=self.admission_min_tokens,
                           write_queue_blocks=self.write_queue_blocks,
                           io_threads=self.io_threads)

    def as_extra_config(self) -> dict[str, Any]:
        """The non-default settings, as `kv_connector_extra_config` (used by `kvtier serve`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}


def _coerce(name: str, raw: Any, default: Any) -> Any:
    """Convert `raw` (JSON value or env string) to the type of the field's default."""
    if raw is None or raw == "":
        return None if default is None else default
    try:
        if isinstance(default, bool):
            return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
        if isinstance(default, int):
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: cannot read {raw!r} as {type(default).__name__}") from exc


CONNECTOR_CLASS = "KvtierConnector"
CONNECTOR_MODULE = "kvtier.vllm.connector"


def kv_transfer_config(config: ConnectorConfig) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` enabling the connector with `config`.

    Load failures are recomputed (`kv_load_failure_policy: "recompute"`): with vLLM's default
    ("fail") a block lost between lookup and load would fail the request.
    """
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": config.as_extra_config()}
