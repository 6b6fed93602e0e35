"""The connector's settings, read from vLLM's `kv_connector_extra_config` or the environment.

`ConnectorSettings` is `StoreSettings` plus what the connector itself needs; every key of
either is accepted in the extra config, or as `KVTIER_<KEY IN UPPER CASE>` in the environment.
A key in the extra config wins over the environment, which wins over the default. Unknown keys
and bad values raise `ConfigError` naming the key or the variable, so a typo never silently runs
with defaults. Imports neither vLLM nor torch: tools build transfer configs with it.

    {"kv_connector": "KvtierConnector",
     "kv_connector_module_path": "kvtier.vllm.connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"l1_bytes": "4GiB", "l2_path": "/mnt/kv"}}
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Annotated, Any, Self

from pydantic import Field, field_validator

from kvtier.core.errors import ConfigError
from kvtier.core.settings import StoreSettings

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "ENV_PREFIX",
    "ConnectorSettings",
    "kv_transfer_config",
    "parse_cpu_list",
]

ENV_PREFIX = "KVTIER_"
CONNECTOR_CLASS = "KvtierConnector"
CONNECTOR_MODULE = "kvtier.vllm.connector"
FLUSH_ON_CLOSE_S = 30.0
"""How long a worker's connector, closing as the engine stops, waits for its queued L2 writes
(`kvtier.vllm.process_store.release`); the worker's exit waits as long."""


class ConnectorSettings(StoreSettings):
    """Settings of one replica's connector: its store (`StoreSettings`), then these."""

    block_tokens: Annotated[int, Field(gt=0)] | None = None
    """Tokens per kvtier block, a multiple of the engine's block size; unset: the engine's
    block size (a hit then never leaves a partly covered engine block to recompute)."""
    events_endpoint: str | None = None
    """ZMQ endpoint this replica's KV-event publisher binds, e.g. tcp://0.0.0.0:5601; unset: no
    events."""
    replica_id: str | None = None
    """Replica id carried by events: the router's name for this replica, usually its base URL
    (an IPv6 host is bracketed as the router writes it: http://fd00::7:8000 is read as
    http://[fd00::7]:8000). Unset: "<hostname>:<pid>"."""
    model_id: str | None = None
    """Model name in the namespace; unset: the model directory's name. Replicas that share blocks
    need the same value and the same weights."""
    lookup_wait_ms: Annotated[float, Field(ge=0)] = 2.0
    """How long the scheduler waits for a lookup it just started before answering "still
    looking": L1 and local L2 lookups finish within it, so a hit is scheduled in the same step;
    a slow mount never delays the scheduler by more than this."""
    lookup_ttl_s: Annotated[float, Field(ge=0)] = 1.0
    """How long a finished scheduler-side lookup answer is trusted."""
    load_threads: Annotated[int, Field(gt=0)] = 1
    """Worker threads moving blocks from the store into vLLM's KV cache."""
    load_async: bool = False
    """Load hits while the engine keeps stepping (the request waits in WAITING_FOR_REMOTE_KVS);
    off: load them inside the step that computes the rest of the prompt, before its forward pass
    (one step less for the hit, but that step's batch waits for the load)."""
    load_deadline_s: Annotated[float, Field(gt=0)] = 2.0
    """Longest wait for one load: past it, the blocks not yet written into vLLM's cache are
    reported failed and recomputed, and the load's late reads are discarded. It bounds how long
    a slow or hung L2 (a stalled FUSE mount) stalls an engine step (synchronous loads) or
    holds a request (asynchronous ones); set it near the time a long prompt takes to compute.
    It bounds the scheduler's lookup for a request too: one not answered within it answers
    "nothing cached" (the prompt is computed), as does every lookup while the lookup thread
    is stuck in one for longer."""
    load_layerwise: bool | None = None
    """Synchronous loads on a CPU engine: copy L1 hits into vLLM's KV cache layer by layer on
    a background CPU while the forward pass runs, which waits only for the layer it reads next,
    and read L2 hits the same way, layer by layer, where the L2 profile allows it (a local
    directory, a JuiceFS mount); off: read and copy them before the forward (on other file
    systems L2 hits are, either way). Unset: on where `background_cpus` gives the connector a
    core the engine is not bound to (on the engine's own cores the copy would take turns with
    the forward, not run beside it)."""
    load_staging: bool = True
    """Read L2 hits into a staging buffer each loader reuses, then copy them into vLLM's KV
    cache; they reach L1 afterwards, when the request's blocks are saved. Off: read each into a
    fresh buffer that L1 adopts at once (promotion on the load's critical path: the fresh
    memory's page faults cost more than the read)."""
    load_read_threads: Annotated[int, Field(ge=0)] = 2
    """L2 blocks one load reads at a time, ahead of their copy into vLLM's KV cache: over a
    FUSE mount a read mostly waits on the daemon, so parallel reads multiply its throughput;
    0: one at a time, on the loader's own thread."""
    background_cpus: str | None = None
    """CPU ids ("0,2-3") the connector's background threads run on: block saves, L2 writes,
    and asynchronous loads (synchronous loads run where the engine waits for them). Unset: the
    CPUs the engine's own threads are not bound to (vLLM's CPU worker binds its threads, and
    so every thread started after, to its cores), or, with none left, the engine's; "inherit":
    always the engine's. Replicas sharing a machine's cores want "inherit" (or spare cores):
    a saver on another replica's busy core starves there (docs/connector.md)."""
    save_backlog_blocks: Annotated[int, Field(gt=0)] = 256
    """Blocks waiting to be copied out of the engine's cache (blocks L1 holds need no copy) beyond
    which a step's new saves are dropped (and counted): a finished request keeps its KV blocks
    until its saves are done, so an unbounded backlog would hold the engine's memory under
    saturation."""

    @field_validator("background_cpus")
    @classmethod
    def _cpus(cls, value: str | None) -> str | None:
        if value is not None and value != "inherit":
            parse_cpu_list(value)
        return value

    @field_validator("replica_id")
    @classmethod
    def _bracketed(cls, value: str | None) -> str | None:
        """A URL's unbracketed IPv6 host (a pod naming itself by `$(POD_IP)`) in brackets."""
        scheme, _, rest = (value or "").partition("://")
        host = rest.partition("/")[0].rpartition(":")[0]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return value
        return f"{scheme}://[{host}]{rest[len(host) :]}"

    @field_validator("events_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and "://" not in value:
            raise ValueError(f"expected a ZMQ endpoint like tcp://127.0.0.1:5601, got {value!r}")
        return value

    @classmethod
    def from_sources(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> Self:
        """Extra-config keys first, then `KVTIER_*` environment variables, then defaults."""
        values = dict(extra or {})
        environ = os.environ if environ is None else environ
        from_env = {}
        for name in cls.model_fields:
            variable = ENV_PREFIX + name.upper()
            if name not in values and environ.get(variable, "") != "":
                values[name] = from_env[name] = environ[variable]
        try:
            return cls.from_mapping(values)
        except ConfigError as exc:
            key = str(exc).split(":", 1)[0]
            if key in from_env:  # name the variable the bad value came from
                raise ConfigError(f"{ENV_PREFIX}{key.upper()}{str(exc)[len(key) :]}") from None
            raise

    def store_settings(self) -> StoreSettings:
        """The store's share of the settings."""
        return StoreSettings.from_mapping(
            {name: getattr(self, name) for name in StoreSettings.model_fields}
        )

    def as_extra_config(self) -> dict[str, Any]:
        """The settings given explicitly (a default included), as `kv_connector_extra_config`:
        the extra config wins over the replica's `KVTIER_*` environment, so a value a flag or
        the deployment file sets is never replaced by a variable the replica inherited."""
        return self.model_dump(exclude_unset=True)


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids of a list like "0,2-3" (Linux cpulist syntax)."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"expected CPU ids like 0,2-3, got {text!r}")
        cpus.update(range(int(first), int(last if sep else first) + 1))
    if not cpus:
        raise ValueError(f"expected CPU ids like 0,2-3, got {text!r}")
    return cpus


def kv_transfer_config(settings: ConnectorSettings) -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` enabling the connector with `settings`.

    Load failures are recomputed (`kv_load_failure_policy: "recompute"`): with vLLM's default
    ("fail") a block lost between lookup and load would fail the request.
    """
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": settings.as_extra_config(),
    }
