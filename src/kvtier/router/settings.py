"""Router settings and the replica list file.

    RouterSettings(replicas=["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                   strategy="kvaware", events=["tcp://127.0.0.1:5601"])

A replica is given as a URL, `URL=VLLM_EVENTS_ENDPOINT`, or an object `{url, name?,
vllm_events?, vllm_events_replay?}`. A replicas file is YAML or JSON: a list of those, or
`{"replicas": [...]}`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import Field, model_validator

from kvtier.core.errors import ConfigError
from kvtier.core.settings import ByteSize, Settings

__all__ = ["STRATEGIES", "ReplicaSettings", "RouterSettings", "Strategy", "load_replicas_file"]

Strategy = Literal["prefixaware", "kvaware", "session", "roundrobin", "leastload"]
"""Routing strategies served by `kvtier router` (see `kvtier.router.policies`)."""
STRATEGIES: tuple[str, ...] = Strategy.__args__  # type: ignore[attr-defined]


_ZMQ_ENDPOINT = re.compile(r"tcp://[^\s*]+:\d+|ipc://\S+")
"""What the router can connect a ZMQ socket to: tcp://HOST:PORT or ipc://PATH."""


def replica_fields(text: str) -> dict[str, Any]:
    """The fields a replica given as "URL" or "URL=VLLM_EVENTS_ENDPOINT" stands for."""
    url, _, events = text.partition("=")
    return {"url": url, "vllm_events": events or None}


class ReplicaSettings(Settings):
    """One vLLM replica behind the router."""

    url: str
    """Base URL of a vLLM OpenAI server, e.g. http://127.0.0.1:8001 (https:// with TLS)."""
    name: str = ""
    """Name in metrics and KV events; defaults to the URL (what the kvtier connector uses)."""
    vllm_events: str | None = None
    """ZMQ endpoint of vLLM's own KV events (`--kv-events-config`), feeding L0 of `kvaware`."""
    vllm_events_replay: str | None = None
    """ZMQ endpoint of that publisher's replay socket (`replay_endpoint` of
    `--kv-events-config`): batches lost in transit (a gap in their sequence) are asked back
    from it. Only with `vllm_events`."""

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        return replica_fields(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Self:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: {self.url!r} is not an http(s) base URL")
        for field in ("vllm_events", "vllm_events_replay"):
            endpoint = getattr(self, field)
            if endpoint is not None and not _ZMQ_ENDPOINT.fullmatch(endpoint):
                raise ValueError(
                    f"{field}: {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH)"
                )
        if self.vllm_events_replay is not None and self.vllm_events is None:
            raise ValueError("vllm_events_replay: only meaningful with vllm_events")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.name:
            object.__setattr__(self, "name", self.url)
        return self


class RouterSettings(Settings):
    """Everything `kvtier router` and the `Router` app take."""

    replicas: tuple[ReplicaSettings, ...] = ()
    """The vLLM replicas behind the router (and/or those found by `replicas_dns`)."""
    strategy: Strategy = "prefixaware"
    """Routing strategy: prefixaware remembers what it routed; kvaware follows the replicas' KV
    events; session sticks on a header or the body's `user`; roundrobin and leastload ignore
    the cache."""
    host: str = "127.0.0.1"
    """Listen address."""
    port: Annotated[int, Field(ge=0, lt=65536)] = 8000
    """Listen port (0: any free port)."""
    api_key: Annotated[str, Field(min_length=1)] | None = None
    """When set, requests to /v1/* must carry `Authorization: Bearer <api_key>`. A key given
    here shows in process listings: prefer `api_keys_file` or $KVTIER_API_KEYS."""
    api_keys_file: str | None = None
    """File of API keys, one `KEY` or `TENANT KEY` per line, re-read when it changes (rotation
    without a restart); keys may also come from $KVTIER_API_KEYS. A tenant's requests get their
    own cache namespace (see `kvtier.router.auth`)."""
    shared_cache_tenants: tuple[str, ...] = ()
    """Tenants allowed to share the unsalted cache namespace (with each other and with keys that
    name no tenant); every other tenant's cached blocks are its own."""
    model_dir: str | None = None
    """Local HF model directory for the tokenizer and chat template; unset: the embedded
    model."""
    block_tokens: Annotated[int, Field(gt=0)] | None = None
    """Tokens per hashed block, the engines' block size; unset: read from the replicas
    (`vllm:cache_config_info` on their /metrics)."""
    max_model_len: Annotated[int, Field(gt=0)] | None = None
    """Longest prompt + 1 a replica accepts; unset: learned from the replicas' /v1/models."""
    events: tuple[str, ...] = ()
    """ZMQ endpoints of kvtier connector KV events (L1/L2 tiers), for kvaware."""
    session_header: Annotated[str, Field(min_length=1)] = "x-session-id"
    """Header naming a sticky session for `session` (falls back to the body's `user`)."""
    max_blocks: Annotated[int, Field(gt=0)] = 1_000_000
    """Bound of each prefix index, in (replica, block) entries."""
    health_interval_s: Annotated[float, Field(gt=0)] = 1.0
    """Seconds between active health checks of each replica."""
    health_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    """Timeout of one health check."""
    models_refresh_s: Annotated[float, Field(ge=0)] = 30.0
    """Seconds between re-reads of a healthy replica's /v1/models and /metrics (read when it
    comes up too): LoRA adapters loaded or unloaded at run time (`/v1/load_lora_adapter`) are
    served, and refused, at most this long later. 0: read only when a replica comes up."""
    unhealthy_after: Annotated[int, Field(gt=0)] = 2
    """Consecutive failed checks before a replica is down (and its index entries purged)."""
    stall_after_s: Annotated[float, Field(ge=0)] = 60.0
    """A replica holding requests that got no byte from it for this long is probed with a
    1-token completion; no answer within this long again: stalled (its engine hangs while
    /health is green), out of rotation and its unanswered requests failed over, until a probe
    is answered. Keep it above the longest prefill a replica may run with every other request
    queued behind it (the probe waits too). 0: off."""
    connect_timeout_s: Annotated[float, Field(gt=0)] = 3.0
    """Connecting to a replica; a timeout fails over to another replica."""
    read_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Longest silence from a replica mid-response before the request fails."""
    max_body_bytes: Annotated[ByteSize, Field(gt=0)] = 16 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    max_header_bytes: Annotated[ByteSize, Field(gt=0)] = 64 * 1024
    """Largest request head (request line and headers) accepted (431 beyond)."""
    client_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    """Time a client has to send a request's head, and again its body: a connection that
    trickles them slower is answered 408 and closed. Also the time a client may take no more of
    an answer (a stream it stopped reading): its connection is then dropped."""
    max_connections: Annotated[int, Field(gt=0)] = 1024
    """Open client connections (and requests) served at once; beyond, new ones get a 503. With
    the two limits above this bounds the memory clients can hold in the router."""
    drain_s: Annotated[int, Field(ge=0)] = 30
    """On SIGTERM the router stops accepting connections and lets the requests in flight
    finish for up to this long, then cuts what is left (a second Ctrl-C cuts at once)."""
    events_curve_server_key: str | None = None
    """Z85 CURVE public key of the replicas' KV-event publishers: set, event sockets are
    encrypted and only a publisher holding the matching secret key is heard (see
    `kvtier.net.kv_events`)."""
    replica_ca_file: str | None = None
    """CA bundle (PEM) that signs the https:// replicas' certificates; unset: the system's."""
    seed: int | None = None
    """Seed of the tie-breaking random generator; unset: from the OS."""
    replicas_dns: str | None = None
    """HOST:PORT whose every DNS address is a replica at http://ADDRESS:PORT (a Kubernetes
    headless Service), re-resolved every `discovery_interval_s`: a new address joins after a
    good health check, a vanished one is drained, then dropped and purged from the index. Works
    beside or instead of `replicas` (see `kvtier.router.discovery`)."""
    discovery_interval_s: Annotated[float, Field(gt=0)] = 5.0
    """Seconds between two resolutions of `replicas_dns`."""
    replica_events_port: Annotated[int, Field(gt=0, lt=65536)] | None = None
    """Port of the kvtier KV-event publisher on every discovered replica (followed at
    tcp://ADDRESS:PORT, for kvaware); unset: discovered replicas' events are not followed."""
    replica_vllm_events_port: Annotated[int, Field(gt=0, lt=65536)] | None = None
    """Port of vLLM's own KV-event publisher (`--kv-events-config`) on every discovered
    replica, followed at tcp://ADDRESS:PORT as that replica's `vllm_events` (L0 of kvaware);
    unset: not followed."""
    replica_vllm_replay_port: Annotated[int, Field(gt=0, lt=65536)] | None = None
    """Port of that publisher's replay socket on every discovered replica (tcp://ADDRESS:PORT,
    the replica's `vllm_events_replay`): gaps in its events are asked back from it. Only with
    `replica_vllm_events_port`."""
    drain_timeout_s: Annotated[float, Field(ge=0)] = 60.0
    """A replica gone from `replicas_dns` gets no new requests and is dropped once its last
    request ends, or after this many seconds."""
    consistent_ties: bool = False
    """Break routing ties by a hash of the prompt (rendezvous) instead of at random, so several
    routers with the same view choose the same replica."""

    @model_validator(mode="before")
    @classmethod
    def _replica_list(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("replicas"), str):
            value = {**value, "replicas": [value["replicas"]]}
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.replicas and self.replicas_dns is None:
            raise ValueError(
                "replicas: at least one replica is required (--replica URL, --replicas-file FILE"
                " or --replicas-dns HOST:PORT)"
            )
        if self.replicas_dns is not None:
            host, _, port = self.replicas_dns.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"replicas_dns: expected HOST:PORT, got {self.replicas_dns!r}")
        if self.replica_vllm_replay_port is not None and self.replica_vllm_events_port is None:
            raise ValueError(
                "replica_vllm_replay_port: only meaningful with replica_vllm_events_port"
            )
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replicas: duplicate names in {names}")
        return self


def load_replicas_file(path: str | Path) -> tuple[ReplicaSettings, ...]:
    """Replicas listed in a YAML or JSON file (JSON is YAML)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"replicas_file: cannot read {path}: {exc}") from exc
    if isinstance(doc, dict):
        doc = doc.get("replicas")
    if not isinstance(doc, Sequence) or isinstance(doc, str) or not doc:
        raise ConfigError(f"replicas_file: {path} holds no list of replicas")
    entries = []
    for i, entry in enumerate(doc):
        if not isinstance(entry, (str, dict)):
            raise ConfigError(
                f"replicas_file {path} entry {i}: expected a URL or an object with 'url'"
            )
        entries.append(
            ReplicaSettings.from_mapping(
                entry if isinstance(entry, dict) else replica_fields(entry),
                where=f"replicas_file {path} entry {i}",
            )
        )
    return tuple(entries)
