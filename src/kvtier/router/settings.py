"""Router settings and the replica list file.

    RouterConfig(replicas=(ReplicaConfig("http://127.0.0.1:8001"),
                           ReplicaConfig("http://127.0.0.1:8002")),
                 strategy="kvaware", events=("tcp://127.0.0.1:5601",))

A replicas file is YAML or JSON: a list of URLs or of objects
`{url, name?, vllm_events?}`, or an object `{"replicas": [...]}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from kvtier.core.errors import ConfigError

__all__ = ["ReplicaConfig", "RouterConfig", "load_replicas_file"]


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    url: str
    """Base URL of a vLLM OpenAI server, e.g. http://127.0.0.1:8001."""
    name: str = ""
    """Name in metrics and KV events; defaults to the URL (what the kvtier connector uses)."""
    vllm_events: str | None = None
    """ZMQ endpoint of vLLM's own KV events (`--kv-events-config`), feeding L0 of `kvaware`."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"replica url: {self.url!r} is not an http(s) base URL")
        if self.url.endswith("/"):
            object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.name:
            object.__setattr__(self, "name", self.url)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    replicas: tuple[ReplicaConfig, ...]
    """The vLLM replicas behind the router."""
    strategy: str = "prefixaware"
    """Routing strategy (see `kvtier.router.policies.POLICIES`)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, requests must carry `Authorization: Bearer <api_key>` (`/health` excepted)."""
    model_dir: str | None = None
    """Local HF model directory for the tokenizer; None: the embedded model."""
    block_tokens: int = 128
    """Tokens per hashed block: the ENGINE's block size (128 on vLLM CPU)."""
    max_model_len: int | None = None
    """Longest prompt + 1 a replica accepts; None: learned from the replicas' /v1/models."""
    events: tuple[str, ...] = ()
    """ZMQ endpoints of kvtier connector KV events (L1/L2 tiers), for `kvaware`."""
    session_header: str = "x-session-id"
    """Header naming a sticky session for `session` (falls back to the body's `user`)."""
    max_blocks: int = 1_000_000
    """Bound of each prefix index, in (replica, block) entries."""
    health_interval_s: float = 1.0
    """Seconds between active health checks of each replica."""
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    """Consecutive failed checks before a replica is down (and its index entries purged)."""
    connect_timeout_s: float = 3.0
    """Connecting to a replica; a timeout fails over to another replica."""
    read_timeout_s: float = 600.0
    """Longest silence from a replica mid-response before the request fails."""
    max_body_bytes: int = 16 * 1024 * 1024
    seed: int | None = None
    """Seed of the tie-breaking random generator (None: from the OS)."""

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("replicas: at least one replica is required")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ConfigError(f"replicas: duplicate names in {names}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        for field in ("block_tokens", "max_blocks", "unhealthy_after", "max_body_bytes"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"{field}: must be positive, got {getattr(self, field)}")
        for field in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                      "read_timeout_s"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"{field}: must be positive, got {getattr(self, field)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len: must be positive, got {self.max_model_len}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key: must not be empty when given")
        if not self.session_header:
            raise ConfigError("session_header: must not be empty")


def _replica(entry: object, where: str) -> ReplicaConfig:
    if isinstance(entry, str):
        return ReplicaConfig(entry)
    if isinstance(entry, dict) and isinstance(entry.get("url"), str):
        unknown = set(entry) - {"url", "name", "vllm_events"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        return ReplicaConfig(entry["url"], str(entry.get("name") or ""),
                             entry.get("vllm_events"))
    raise ConfigError(f"{where}: expected a URL or an object with 'url'")


def load_replicas_file(path: str | Path) -> tuple[ReplicaConfig, ...]:
    """Replicas listed in a YAML or JSON file (JSON is YAML)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"replicas_file: cannot read {path}: {exc}") from exc
    if isinstance(doc, dict):
        doc = doc.get("replicas")
    if not isinstance(doc, Sequence) or isinstance(doc, str) or not doc:
        raise ConfigError(f"replicas_file: {path} holds no list of replicas")
    return tuple(_replica(e, f"replicas_file {path} entry {i}") for i, e in enumerate(doc))
