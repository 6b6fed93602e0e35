"""The deployment file of `kvtier up`: one YAML document for the whole fleet.

Its top-level keys map one to one onto SageMaker HyperPod's inference CRD, so a HyperPod user
reads it without a manual; `kvtier:` holds what HyperPod has no name for, including any
connector or router setting (`kvtier.connector`, `kvtier.router`: the keys of
`ConnectorSettings` and `RouterSettings`, with their units and checks).

    model: null                    # local HF model directory; null = the embedded model
    replicas: 2
    intelligentRoutingSpec:
      enabled: true                # false: plain round robin, no kvtier routing
      routingStrategy: kvaware     # prefixaware | kvaware | session | roundrobin | leastload
    kvCacheSpec:
      enableL1Cache: true
      l1CacheSizeGiB: 2
      enableL2Cache: true
      l2CacheSpec:
        l2CacheBackend: posix      # posix | tieredstorage (= posix) | juicefs | valkey | redis
        l2CachePath: null          # posix: shared directory (default: under workDir)
        l2CacheLocalUrl: null      # valkey/redis: redis://127.0.0.1:PORT (default: start one)
        l2CacheSizeGiB: 8          # capacity of the shared L2 (directory janitor / maxmemory)
    kvtier:
      routerPort: 8000
      replicaBasePort: 8100
      engineKvCacheGiB: 1          # each engine's own cache (L0) ...
      engineKvCacheBlocks: null    # ... or exactly this many engine blocks (small-HBM setups)
      threadsPerReplica: 1
      engineDtype: auto            # auto (bfloat16 where the CPU has it natively) | float32 | ...
      replicaDrainSeconds: 90      # a stopped replica finishes its requests in flight (0: aborts)
      vllmKvEvents: true           # kvaware: the router follows vLLM's own KV events (L0)
      workDir: .kvtier/cluster     # logs, default L2 directory, pid file
      logMaxMiB: 64                # each log's bound: past it, copied to <name>.1 and emptied
      connector: {}                # e.g. {block_tokens: 256, admission: reused}
      router: {}                   # e.g. {health_interval_s: 0.5, max_blocks: 2000000}
    kubernetes: {}                 # the fleet on a cluster (`kvtier deploy render`)

`load_spec` validates every key and raises `ConfigError` naming its full path
(`kvCacheSpec.l2CacheSpec.l2CacheBackend: ...`); unknown keys are errors too (typos must not be
silently ignored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from kvtier.core.errors import ConfigError
from kvtier.core.settings import Settings
from kvtier.router.settings import RouterSettings, Strategy
from kvtier.tools.deploy.settings import KubernetesSpec
from kvtier.vllm.settings import ConnectorSettings

__all__ = [
    "CacheSpec",
    "FleetSpec",
    "L2Spec",
    "LocalSpec",
    "RoutingSpec",
    "load_spec",
    "parse_spec",
    "read_document",
]

GIB = 1024**3
Port = Annotated[int, Field(ge=1024, le=65535)]
L2Backend = Annotated[
    Literal["posix", "tieredstorage", "juicefs", "valkey", "redis"],
    BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v),
]

CONNECTOR_KEYS_SET_BY_THE_FLEET = {
    "l1_bytes": "kvCacheSpec.l1CacheSizeGiB",
    "l2_path": "kvCacheSpec.l2CacheSpec",
    "l2_url": "kvCacheSpec.l2CacheSpec",
    "l2_capacity_bytes": "kvCacheSpec.l2CacheSpec",
    "l2_profile": "kvCacheSpec.l2CacheSpec.l2CacheBackend",
    "replica_id": "the fleet",
    "events_endpoint": "the fleet",
}
ROUTER_KEYS_SET_BY_THE_FLEET = {
    "replicas": "replicas",
    "strategy": "intelligentRoutingSpec",
    "host": "the fleet",
    "port": "kvtier.routerPort",
    "events": "the fleet",
    "model_dir": "model",
}


class Section(Settings):
    """A section of the deployment file: strict types (a quoted "2" is not a number)."""

    model_config = ConfigDict(**Settings.model_config, strict=True)


class RoutingSpec(Section):
    """`intelligentRoutingSpec`."""

    enabled: bool = True
    """False: the router still fronts the replicas, but only round-robins."""
    strategy: Strategy = Field("kvaware", alias="routingStrategy")
    """Routing strategy when enabled."""


class L2Spec(Section):
    """`kvCacheSpec.l2CacheSpec`."""

    backend: L2Backend = Field("posix", alias="l2CacheBackend")
    """Where the shared L2 lives: a directory (posix, tieredstorage), JuiceFS mounts, or a
    Valkey/Redis server."""
    path: str | None = Field(None, alias="l2CachePath")
    """posix: the shared directory (default: under workDir)."""
    url: str | None = Field(None, alias="l2CacheLocalUrl")
    """valkey/redis: the server's URL (default: start one)."""
    size_gib: Annotated[float, Field(gt=0)] = Field(8.0, alias="l2CacheSizeGiB")
    """Capacity of the shared L2 in GiB (directory janitor or Valkey maxmemory)."""
    persistent: bool = Field(False, alias="l2CachePersistent")
    """valkey: the server kvtier starts keeps its blocks across a restart (an append-only file
    synced once a second; in Kubernetes on a volume claim of its own). A directory or JuiceFS L2
    keeps them anyway."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.url is not None and not self.url.startswith(("redis://", "valkey://")):
            raise ValueError(f"l2CacheLocalUrl: {self.url!r} is not a redis:// or valkey:// URL")
        if self.persistent and self.kind != "valkey":
            raise ValueError(
                f"l2CachePersistent: only for the valkey backend; a {self.backend} L2 is files "
                "and keeps its blocks anyway"
            )
        if self.persistent and self.url is not None:
            raise ValueError(
                "l2CachePersistent: kvtier starts no Valkey server when l2CacheLocalUrl is set; "
                "turn on persistence in that server's own configuration (appendonly yes)"
            )
        return self

    @property
    def kind(self) -> Literal["posix", "juicefs", "valkey"]:
        """The backend, with its aliases resolved (tieredstorage is posix, redis is valkey)."""
        return {"tieredstorage": "posix", "redis": "valkey"}.get(  # type: ignore[return-value]
            self.backend, self.backend
        )


class CacheSpec(Section):
    """`kvCacheSpec`."""

    l1_enabled: bool = Field(True, alias="enableL1Cache")
    """Each replica keeps an L1 in host memory."""
    l1_gib: Annotated[float, Field(gt=0)] = Field(2.0, alias="l1CacheSizeGiB")
    """L1 size per replica in GiB."""
    l2_enabled: bool = Field(True, alias="enableL2Cache")
    """The replicas share an L2."""
    l2: L2Spec = Field(default_factory=L2Spec, alias="l2CacheSpec")
    """Where the shared L2 lives."""

    @property
    def connector_enabled(self) -> bool:
        return self.l1_enabled or self.l2_enabled


class LocalSpec(Section):
    """`kvtier`: what HyperPod has no name for."""

    router_port: Port = Field(8000, alias="routerPort")
    """Port of the router's OpenAI API."""
    replica_base_port: Port = Field(8100, alias="replicaBasePort")
    """Replica i serves on this port + i."""
    engine_kv_cache_gib: Annotated[int, Field(gt=0)] = Field(1, alias="engineKvCacheGiB")
    """Each engine's own KV cache (L0) in GiB ..."""
    engine_kv_cache_blocks: Annotated[int, Field(gt=0)] | None = Field(
        None, alias="engineKvCacheBlocks"
    )
    """... or exactly this many engine blocks (small-HBM setups)."""
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", alias="engineDtype"
    )
    """Engine dtype; auto: bfloat16 where the CPU computes it natively, else float32."""
    threads_per_replica: Annotated[int, Field(gt=0)] = Field(1, alias="threadsPerReplica")
    """Engine threads per replica (vLLM on CPU), pinned to their own cores; unbound when all
    replicas' threads outnumber the cores."""
    replica_drain_s: Annotated[int, Field(ge=0)] = Field(90, alias="replicaDrainSeconds")
    """A replica being stopped finishes its requests in flight for up to this long (vLLM's
    `--shutdown-timeout`; new requests fail over); 0: they are aborted at once."""
    vllm_kv_events: bool = Field(True, alias="vllmKvEvents")
    """With kvaware routing, the replicas publish vLLM's own KV events (what each engine's
    own cache, L0, holds and evicts) and the router follows them; off: the router knows L0
    only from its own decisions and the connector's L1/L2 events."""
    work_dir: str = Field(".kvtier/cluster", alias="workDir")
    """Logs, the default L2 directory, the pid file."""
    log_max_mib: Annotated[int, Field(ge=0)] = Field(64, alias="logMaxMiB")
    """Bound of each log in workDir (the replicas', the router's, the Valkey server's, the
    JuiceFS mounts', Prometheus'), in MiB: while `kvtier up` runs, a log grown past it is copied
    to `<name>.1` (replacing the one before) and emptied in place, checked every 5 s; lines
    written between the copy and the emptying are lost. 0: unbounded."""
    connector: dict[str, Any] = Field(default_factory=dict)
    """Connector settings for every replica (keys of `ConnectorSettings`)."""
    router: dict[str, Any] = Field(default_factory=dict)
    """Router settings (keys of `RouterSettings`)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        for section, reserved in (
            ("connector", CONNECTOR_KEYS_SET_BY_THE_FLEET),
            ("router", ROUTER_KEYS_SET_BY_THE_FLEET),
        ):
            for key in getattr(self, section):
                if key in reserved:
                    raise ValueError(f"{section}.{key}: set by {reserved[key]}")
        ConnectorSettings.from_mapping(self.connector, where="kvtier.connector")
        self.router_settings()
        return self

    def router_settings(self) -> RouterSettings:
        """`router` validated (with a placeholder replica: the fleet sets the real ones)."""
        return RouterSettings.from_mapping(
            {**self.router, "replicas": ["http://127.0.0.1:1"]}, where="kvtier.router"
        )


class FleetSpec(Section):
    """The whole deployment file (see the module docstring)."""

    model: str | None = None
    """Local HF model directory; unset: the embedded model."""
    replicas: Annotated[int, Field(gt=0)] = 2
    """vLLM replicas, each with the kvtier connector (when a cache tier is enabled)."""
    routing: RoutingSpec = Field(default_factory=RoutingSpec, alias="intelligentRoutingSpec")
    """How the router picks a replica (HyperPod's intelligent routing)."""
    cache: CacheSpec = Field(default_factory=CacheSpec, alias="kvCacheSpec")
    """The cache tiers (HyperPod's KV cache spec)."""
    local: LocalSpec = Field(default_factory=LocalSpec, alias="kvtier")
    """What HyperPod has no name for: ports, engine cache, work directory, any connector or
    router setting."""
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    """The fleet on a Kubernetes cluster (`kvtier deploy render`; `kvtier up` ignores it)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        last = self.local.replica_base_port + self.replicas - 1
        if last > 65535:
            raise ValueError(f"kvtier.replicaBasePort: + replicas - 1 = {last} is not a port")
        if self.local.replica_base_port <= self.local.router_port <= last:
            raise ValueError("kvtier.routerPort: collides with a replica port")
        return self

    @property
    def strategy(self) -> str:
        """The strategy the router runs (round robin when intelligent routing is off)."""
        return self.routing.strategy if self.routing.enabled else "roundrobin"

    @property
    def work_dir(self) -> Path:
        return Path(self.local.work_dir)

    @property
    def router_drain_s(self) -> int:
        """How long a stopped router lets its requests in flight finish (`kvtier.router`'s
        `drain_s`, else the router's default)."""
        return self.local.router_settings().drain_s

    def connector_settings(
        self,
        *,
        replica_id: str,
        events_endpoint: str,
        l2_location: str | None,
        defaults: dict[str, Any] | None = None,
    ) -> ConnectorSettings | None:
        """One replica's connector settings (None: no connector): the cache spec's, then
        `kvtier.connector`'s, then `defaults`; `l2_location` is its L2 path or URL."""
        cache = self.cache
        if not cache.connector_enabled:
            return None
        values: dict[str, Any] = {
            "l1_bytes": int(cache.l1_gib * GIB) if cache.l1_enabled else 0,
            "replica_id": replica_id,
            "events_endpoint": events_endpoint,
        }
        if l2_location is not None and cache.l2.kind == "valkey":
            values["l2_url"] = l2_location
        elif l2_location is not None:
            values.update(
                l2_path=l2_location,
                l2_capacity_bytes=int(cache.l2.size_gib * GIB),
                l2_profile="juicefs" if cache.l2.kind == "juicefs" else "local",
            )
        return ConnectorSettings.from_mapping(
            {**(defaults or {}), **self.local.connector, **values}
        )


def parse_spec(data: object) -> FleetSpec:
    """The spec in a parsed YAML document (None: every default)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"document: must be a mapping, got {type(data).__name__}")
    return FleetSpec.from_mapping(data)


def read_document(path: Path) -> object:
    """The YAML document in `path`; ConfigError when it cannot be read or parsed."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc


def load_spec(path: Path | None) -> FleetSpec:
    """The spec in `path` (YAML), or the defaults when `path` is None."""
    return parse_spec({} if path is None else read_document(path))
