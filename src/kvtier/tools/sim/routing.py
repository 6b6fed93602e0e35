"""Build the router's own strategies for the simulator, unchanged.

The simulator never re-implements routing: it calls `kvtier.router.policies.make_policy` and
drives `choose`/`observe_routed` with simulated time and a seeded `random.Random`. Two
adaptations happen here, both on the way in:

- flat options (`queue_weight=0.5`, as the CLI gives them) that name `CostWeights` fields are
  gathered into the `weights=` object the cost-based strategies take;
- a strategy whose constructor takes an `index` (the event-fed precise index of `kvaware`) gets
  one that the simulator keeps equal to its simulated tier contents, as KV events would.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvtier.core.errors import ConfigError
from kvtier.router.index import PrefixIndex
from kvtier.router.policies import POLICIES, CostWeights, Policy, make_policy

__all__ = ["Strategy", "build_strategy", "parse_option", "strategy_names"]

_WEIGHT_FIELDS = frozenset(f.name for f in fields(CostWeights))


@dataclass(frozen=True, slots=True)
class Strategy:
    """A routing policy plus, when it consumes KV events, the index the simulator feeds."""

    policy: Policy
    index: PrefixIndex | None


def strategy_names() -> list[str]:
    return sorted(POLICIES)


def parse_option(text: str) -> tuple[str, object]:
    """`KEY=VALUE` with VALUE read as an int, a float, true/false, or else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"policy option: expected KEY=VALUE, got {text!r}")
    value: object
    lowered = raw.lower()
    if lowered in {"true", "false"}:
        value = lowered == "true"
    else:
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                value = raw
    return key, value


def _cost_weights(options: Mapping[str, object]) -> CostWeights:
    """`CostWeights` of these policy options; a `ConfigError` names one that is no number."""
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"policy option: {key}={value!r} is not a number")
    return CostWeights(**options)  # type: ignore[arg-type]


def build_strategy(name: str, options: Mapping[str, object], index_max_blocks: int) -> Strategy:
    if name not in POLICIES:
        make_policy(name)  # raises the router's own ConfigError naming the choices
    params = inspect.signature(POLICIES[name]).parameters
    kwargs = {k: v for k, v in options.items() if k not in _WEIGHT_FIELDS}
    weights = {k: v for k, v in options.items() if k in _WEIGHT_FIELDS}
    if weights:
        if "weights" not in params:
            raise ConfigError(
                f"policy option: {', '.join(sorted(weights))} do not apply to "
                f"strategy {name} (no cost weights)"
            )
        kwargs["weights"] = _cost_weights(weights)
    index: PrefixIndex | None = None
    if "index" in params:
        if "index" in kwargs:
            raise ConfigError("policy option: index is the simulator's to build")
        index = PrefixIndex(index_max_blocks)
        kwargs["index"] = index
    return Strategy(make_policy(name, **kwargs), index)
