"""The simulator's cost model: how long prefill, tier loads and decode take.

    TTFT = queueing + overhead + load of cached blocks (per tier) + prefill of the other tokens

- prefill is linear in the uncached prompt tokens (`prefill_tokens_per_s`);
- an L0 hit is free; an L1 hit reads `kv_bytes_per_token` per token at `l1_read_bytes_per_s`
  (host memory of the replica); an L2 hit at `l2_read_bytes_per_s` per reader, and every L2
  read also passes through the pool's aggregate `l2_pool_read_bytes_per_s` (shared by the fleet,
  first come first served — the fleet keeps that queue);
- a tier whose read is slower than recomputing is recomputed instead (the connector's rule: a
  slow L2 never makes TTFT worse than no cache);
- decode runs at `decode_tokens_per_s` per request and only keeps the request in flight.

Profiles live in `kvtier/tools/sim/costs.json`, each number with its source; `load_costs` picks a
profile by name (or reads another file of the same shape) and applies overrides.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.base import Tier

__all__ = ["CostModel", "load_costs", "profile_names"]


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-replica speeds and default capacities of one hardware/model profile."""

    prefill_tokens_per_s: float
    """Uncached prompt tokens one replica computes per second."""
    request_overhead_s: float
    """Fixed time per request before its first token (scheduling, first decode step)."""
    decode_tokens_per_s: float
    """Output tokens per second of one request once it decodes."""
    kv_bytes_per_token: int
    """KV bytes of one token (all layers): turns tokens into bytes to read and GiB into blocks."""
    l1_read_bytes_per_s: float
    """L1 (host memory of the replica) read rate into the engine."""
    l2_read_bytes_per_s: float
    """L2 read rate of one reader (one replica)."""
    l2_pool_read_bytes_per_s: float
    """Aggregate L2 read rate of the whole pool, shared by all replicas (`inf`: unbounded)."""
    l0_gib: float
    """Default L0 (engine KV cache) size per replica."""
    l1_gib: float
    """Default L1 size per replica."""
    l2_gib: float
    """Default size of the shared L2 pool."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            positive = f.name not in {"request_overhead_s", "l0_gib", "l1_gib", "l2_gib"}
            if math.isnan(value) or value < 0 or (positive and value == 0):
                need = "positive" if positive else ">= 0"
                raise ConfigError(f"{f.name}: must be {need}, got {value}")

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def read_s(self, tier: Tier, tokens: int) -> float:
        """Time one replica spends reading `tokens` of KV from `tier`, excluding pool queueing."""
        if tier is Tier.L0 or tokens == 0:
            return 0.0
        rate = self.l1_read_bytes_per_s if tier is Tier.L1 else self.l2_read_bytes_per_s
        return tokens * self.kv_bytes_per_token / rate

    def worth_loading(self, tier: Tier) -> bool:
        """Whether reading a token from `tier` beats recomputing it."""
        return self.read_s(tier, 1) < self.prefill_s(1)

    def pool_s(self, tokens: int) -> float:
        """Time `tokens` of L2 reads occupy the shared pool."""
        return tokens * self.kv_bytes_per_token / self.l2_pool_read_bytes_per_s

    def decode_s(self, tokens: int) -> float:
        return tokens / self.decode_tokens_per_s

    def default_blocks(self, tier: Tier, block_tokens: int) -> int:
        """Default capacity of `tier` in blocks of `block_tokens` tokens."""
        gib = {Tier.L0: self.l0_gib, Tier.L1: self.l1_gib, Tier.L2: self.l2_gib}[tier]
        return int(gib * 2**30 // (self.kv_bytes_per_token * block_tokens))


def _read_profiles(path: Path | None) -> dict[str, Any]:
    if path is None:
        text = resources.files("kvtier.tools.sim").joinpath("costs.json").read_text()
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"costs: cannot read {path} ({exc})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"costs: {path or 'costs.json'} is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("profiles"), dict):
        raise ConfigError(f"costs: {path or 'costs.json'} has no 'profiles' object")
    return doc


def profile_names() -> list[str]:
    return sorted(_read_profiles(None)["profiles"])


def load_costs(profile: str | None = None, overrides: dict[str, float] | None = None) -> CostModel:
    """The named profile of the bundled costs.json, or the default profile of a JSON file.

    `profile` is a profile name, a path to a file of the same shape (its "default" profile is
    used), or None for the bundled default. `overrides` replaces single fields.
    """
    path = Path(profile) if profile and profile.endswith(".json") else None
    doc = _read_profiles(path)
    profiles: dict[str, dict[str, Any]] = doc["profiles"]
    if path is not None or profile is None:
        if "default" not in doc:
            raise ConfigError(f"costs: {path or 'costs.json'} names no 'default' profile")
        name = str(doc["default"])
    else:
        name = profile
    if name not in profiles:
        raise ConfigError(
            f"costs: unknown profile {name!r}; choose from "
            f"{', '.join(sorted(profiles))} or give a .json file"
        )
    if not isinstance(profiles[name], dict):
        raise ConfigError(f"costs: profile {name!r} is not an object")
    known = {f.name for f in fields(CostModel)}
    values: dict[str, Any] = {}
    for key in known:
        entry = profiles[name].get(key)
        if not isinstance(entry, dict) or "value" not in entry:
            raise ConfigError(f"costs: profile {name!r} lacks {key}.value")
        values[key] = entry["value"]
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ConfigError(
                f"cost: unknown field {key!r}; choose from {', '.join(sorted(known))}"
            )
        values[key] = value
    try:
        values = {k: float(v) for k, v in values.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"costs: profile {name!r} has a non-numeric value ({exc})") from exc
    if not values["kv_bytes_per_token"].is_integer():
        raise ConfigError(
            f"kv_bytes_per_token: must be a whole number, got {values['kv_bytes_per_token']}"
        )
    values["kv_bytes_per_token"] = int(values["kv_bytes_per_token"])
    return CostModel(**values)
