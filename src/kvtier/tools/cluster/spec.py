"""The deployment file of `kvtier up`: one YAML document for the whole fleet.

Its top-level keys map one to one onto SageMaker HyperPod's inference CRD, so a HyperPod user
reads it without a manual; `kvtier:` holds what HyperPod has no name for.

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
      blockTokens: 128             # tokens per kvtier block (a multiple of the engine's)
      workDir: .kvtier/cluster     # logs, default L2 directory, pid file

`load_spec` validates every key and raises `ConfigError` naming its full path
(`kvCacheSpec.l2CacheSpec.l2CacheBackend: ...`); unknown keys are errors too (typos must not be
silently ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtier.core.errors import ConfigError

STRATEGIES = ("prefixaware", "kvaware", "session", "roundrobin", "leastload")
L2_BACKENDS = {"posix": "posix", "tieredstorage": "posix", "juicefs": "juicefs",
               "valkey": "valkey", "redis": "valkey"}


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    enabled: bool = True
    """False: the router still fronts the replicas, but only round-robins."""
    strategy: str = "kvaware"


@dataclass(frozen=True, slots=True)
class CacheSpec:
    l1_enabled: bool = True
    l1_gib: float = 2.0
    l2_enabled: bool = True
    l2_backend: str = "posix"
    """Normalized: posix | juicefs | valkey."""
    l2_path: str | None = None
    l2_url: str | None = None
    l2_gib: float = 8.0
    """Capacity of the shared L2: enforced by the janitor (directory) or maxmemory (Valkey)."""

    @property
    def connector_enabled(self) -> bool:
        return self.l1_enabled or self.l2_enabled


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model: str | None = None
    replicas: int = 2
    routing: RoutingSpec = RoutingSpec()
    cache: CacheSpec = CacheSpec()
    router_port: int = 8000
    replica_base_port: int = 8100
    engine_kv_cache_gib: int = 1
    engine_kv_cache_blocks: int | None = None
    """Caps the engine's own cache (L0) at this many engine blocks, as on a small GPU."""
    threads_per_replica: int = 1
    block_tokens: int = 128
    work_dir: Path = Path(".kvtier/cluster")

    @property
    def strategy(self) -> str:
        """The strategy the router runs (round robin when intelligent routing is off)."""
        return self.routing.strategy if self.routing.enabled else "roundrobin"


class _Reader:
    """Reads one mapping of the YAML document, tracking its path for error messages."""

    def __init__(self, data: object, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or 'document'}: must be a mapping, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.path = path
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
        self.seen.add(name)
        value = self.data.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise ConfigError(f"{self.key(name)}: expected a number, got {value!r}")
        if not isinstance(value, kind):
            expected = kind.__name__ if isinstance(kind, type) else "number"
            raise ConfigError(f"{self.key(name)}: expected {expected}, got {value!r}")
        return value

    def child(self, name: str) -> _Reader:
        self.seen.add(name)
        return _Reader(self.data.get(name), self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise ConfigError(f"{self.key(unknown[0])}: unknown key (known: "
                              f"{', '.join(sorted(self.seen))})")


def _positive(path: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{path}: must be positive, got {value}")


def _port(path: str, value: int) -> None:
    if not 1024 <= value <= 65535:
        raise ConfigError(f"{path}: must be a port in 1024..65535, got {value}")


def parse_spec(data: object) -> ClusterSpec:
    top = _Reader(data, "")
    model = top.get("model", str, None)
    replicas = top.get("replicas", int, 2)
    _positive("replicas", replicas)

    routing_r = top.child("intelligentRoutingSpec")
    routing = RoutingSpec(enabled=routing_r.get("enabled", bool, True),
                          strategy=routing_r.get("routingStrategy", str, "kvaware"))
    if routing.strategy not in STRATEGIES:
        raise ConfigError(f"intelligentRoutingSpec.routingStrategy: {routing.strategy!r} is not "
                          f"one of {', '.join(STRATEGIES)}")
    routing_r.done()

    cache_r = top.child("kvCacheSpec")
    l1_gib = float(cache_r.get("l1CacheSizeGiB", (int, float), 2.0))
    _positive("kvCacheSpec.l1CacheSizeGiB", l1_gib)
    l2_r = cache_r.child("l2CacheSpec")
    backend = l2_r.get("l2CacheBackend", str, "posix")
    if backend.lower() not in L2_BACKENDS:
        raise ConfigError(f"kvCacheSpec.l2CacheSpec.l2CacheBackend: {backend!r} is not one of "
                          f"{', '.join(L2_BACKENDS)}")
    url = l2_r.get("l2CacheLocalUrl", str, None)
    if url is not None and not url.startswith(("redis://", "valkey://")):
        raise ConfigError(f"kvCacheSpec.l2CacheSpec.l2CacheLocalUrl: {url!r} is not a "
                          "redis:// or valkey:// URL")
    cache = CacheSpec(l1_enabled=cache_r.get("enableL1Cache", bool, True), l1_gib=l1_gib,
                      l2_enabled=cache_r.get("enableL2Cache", bool, True),
                      l2_backend=L2_BACKENDS[backend.lower()],
                      l2_path=l2_r.get("l2CachePath", str, None), l2_url=url,
                      l2_gib=float(l2_r.get("l2CacheSizeGiB", (int, float), 8.0)))
    _positive("kvCacheSpec.l2CacheSpec.l2CacheSizeGiB", cache.l2_gib)
    l2_r.done()
    cache_r.done()

    own = top.child("kvtier")
    spec = ClusterSpec(
        model=model, replicas=replicas, routing=routing, cache=cache,
        router_port=own.get("routerPort", int, 8000),
        replica_base_port=own.get("replicaBasePort", int, 8100),
        engine_kv_cache_gib=own.get("engineKvCacheGiB", int, 1),
        engine_kv_cache_blocks=own.get("engineKvCacheBlocks", int, None),
        threads_per_replica=own.get("threadsPerReplica", int, 1),
        block_tokens=own.get("blockTokens", int, 128),
        work_dir=Path(own.get("workDir", str, ".kvtier/cluster")))
    own.done()
    top.done()
    _port("kvtier.routerPort", spec.router_port)
    _port("kvtier.replicaBasePort", spec.replica_base_port)
    _port("kvtier.replicaBasePort", spec.replica_base_port + spec.replicas - 1)
    if spec.router_port in range(spec.replica_base_port, spec.replica_base_port + replicas):
        raise ConfigError("kvtier.routerPort: collides with a replica port")
    _positive("kvtier.engineKvCacheGiB", spec.engine_kv_cache_gib)
    if spec.engine_kv_cache_blocks is not None:
        _positive("kvtier.engineKvCacheBlocks", spec.engine_kv_cache_blocks)
    _positive("kvtier.threadsPerReplica", spec.threads_per_replica)
    if spec.block_tokens % 16:
        raise ConfigError(f"kvtier.blockTokens: must be a multiple of 16, got {spec.block_tokens}")
    return spec


def load_spec(path: Path | None) -> ClusterSpec:
    """The spec in `path` (YAML), or the defaults when `path` is None."""
    if path is None:
        return parse_spec({})
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    return parse_spec(data)
