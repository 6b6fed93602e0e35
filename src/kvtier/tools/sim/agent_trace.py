"""Synthetic traces of long coding-agent sessions, in the Mooncake JSONL format.

    kvtier sim-trace agents --seed 1 --out agents-1.jsonl
    kvtier sim --trace agents-1.jsonl --replicas 16 --l0-blocks 1400 --l1-blocks 7000 \
        --l2-blocks inf --strategy kvaware

A coding agent (Claude Code, Codex, OpenHands, SWE-agent) runs one long conversation per task:
every turn re-sends the whole context so far, extended by the model's last output (a tool call)
and the tool's result (a file read, a test log). Contexts grow from ~10k tokens (the agent's
instructions and tool schemas, then the task) to hundreds of thousands, and many sessions run
at once. The Mooncake traces hold nothing that long (conversation: mean prompt 12k tokens,
longest 126k), so this generator draws such a workload:

- every session opens with one system prompt shared by all sessions (`system_tokens`: the
  agent's instructions and tool schemas), then a task of its own;
- a session grows to a final context drawn log-uniformly in `[min_context_tokens,
  max_context_tokens]`; each turn adds a step (the last output plus a tool result) drawn
  log-normally (median `step_median_tokens`, capped at `step_max_tokens`: a large file read);
- sessions start uniformly over `start_window_s`; a turn follows the previous one after its
  nominal prefill of the new tokens (`nominal_prefill_tokens_per_s`), its decode
  (`decode_tokens_per_s`) and the tool's run time (exponential, mean `tool_mean_s`). Arrival
  times are fixed in the trace (open loop), as in the Mooncake traces: a fleet slower than
  nominal sees a session's next turn before the last one finished.

Block ids follow the Mooncake rule: one id per 512-token block, equal ids exactly when the
prefixes up to that block are equal. A turn's partial last block gets a fresh id; the next turn
fills it with other tokens, so it gets another id there.

docs/sim.md ("kvaware against prefixaware, by trace shape") gives the size, mean prompt and
ideal block hit rate of the defaults (96 sessions) for seeds 1-3.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from kvtier.core.errors import ConfigError
from kvtier.tools.sim.report import write_output
from kvtier.tools.sim.trace import MOONCAKE_BLOCK_TOKENS

__all__ = ["AgentShape", "agent_rows", "register", "write_rows"]


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The population of agent sessions a trace is drawn from."""

    sessions: int = 96
    """Sessions in the trace, all interleaved."""
    system_tokens: int = 8_192
    """System prompt and tool schemas opening every session (shared by all sessions)."""
    task_min_tokens: int = 1_000
    task_max_tokens: int = 4_000
    """The first user message (the task), uniform in this range."""
    min_context_tokens: int = 10_000
    max_context_tokens: int = 800_000
    """A session's final context is log-uniform in [min, max]."""
    step_median_tokens: int = 3_000
    """Median growth per turn: the model's output plus the tool's result."""
    step_sigma: float = 1.0
    """Log-normal sigma of the growth per turn."""
    step_max_tokens: int = 64_000
    """Cap of one turn's growth (a large file read)."""
    output_median_tokens: int = 300
    """Median output per turn (part of the next turn's growth)."""
    start_window_s: float = 1_800.0
    """Sessions start uniformly over this window."""
    tool_mean_s: float = 5.0
    """Mean run time of a tool between turns (exponential)."""
    decode_tokens_per_s: float = 40.0
    nominal_prefill_tokens_per_s: float = 3_230.0
    """The speed turn gaps assume for the new tokens' prefill (the gpu-7b profile's)."""
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not 0 < value < math.inf:
                raise ConfigError(f"{f.name}: must be positive and finite, got {value}")
        if self.task_min_tokens > self.task_max_tokens:
            raise ConfigError("task_min_tokens: must not exceed task_max_tokens")
        if self.min_context_tokens > self.max_context_tokens:
            raise ConfigError("min_context_tokens: must not exceed max_context_tokens")


class _Ids:
    """Block ids, fresh on every call."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> int:
        self.next += 1
        return self.next - 1


def _session(
    shape: AgentShape, rng: random.Random, ids: _Ids, system: list[int], start_s: float
) -> Iterator[dict[str, object]]:
    bt = shape.block_tokens
    context = shape.system_tokens + rng.randint(shape.task_min_tokens, shape.task_max_tokens)
    final = math.exp(
        rng.uniform(math.log(shape.min_context_tokens), math.log(shape.max_context_tokens))
    )
    full: list[int] = list(system)  # ids of the full blocks of the context so far
    at = start_s
    new_tokens = context
    while True:
        while len(full) < context // bt:
            full.append(ids.take())
        hash_ids = full + ([ids.take()] if context % bt else [])
        output = max(1, round(rng.lognormvariate(math.log(shape.output_median_tokens), 0.8)))
        yield {
            "timestamp": round(at * 1000),
            "input_length": context,
            "output_length": output,
            "hash_ids": hash_ids,
        }
        if context >= final:
            return
        step = rng.lognormvariate(math.log(shape.step_median_tokens), shape.step_sigma)
        step = max(output + 1, min(shape.step_max_tokens, round(step)))
        at += (
            new_tokens / shape.nominal_prefill_tokens_per_s
            + output / shape.decode_tokens_per_s
            + rng.expovariate(1.0 / shape.tool_mean_s)
        )
        context += step
        new_tokens = step


def agent_rows(shape: AgentShape, seed: int) -> list[dict[str, object]]:
    """The trace's requests (Mooncake fields), sorted by arrival; deterministic per seed."""
    rng = random.Random(seed)
    ids = _Ids()
    system = [ids.take() for _ in range(shape.system_tokens // shape.block_tokens)]
    rows: list[dict[str, object]] = []
    for _ in range(shape.sessions):
        start = rng.uniform(0.0, shape.start_window_s)
        rows.extend(_session(shape, random.Random(rng.getrandbits(64)), ids, system, start))
    rows.sort(key=lambda row: row["timestamp"])  # type: ignore[arg-type, return-value]
    return rows


def write_rows(rows: list[dict[str, object]], path: Path) -> None:
    """Write `rows` to `path` as JSONL (a `ConfigError` naming `path` if it cannot)."""
    write_output(path, "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "sim-trace",
        help="generate a synthetic trace for the simulator (long coding-agent sessions)",
        description="Draw a Mooncake-format trace of coding-agent sessions for `kvtier sim`: "
        "every turn re-sends the whole context so far, grown by a tool call and its result, "
        "up to hundreds of thousands of tokens, and many sessions run at once.",
    )
    p.add_argument("shape", choices=["agents"], help="trace shape")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="JSONL to write")
    p.add_argument("--seed", type=int, default=1, help="seed of the draw (default 1)")
    defaults = AgentShape()
    for name, what in (
        ("sessions", "sessions in the trace, all interleaved"),
        ("system_tokens", "system prompt and tool schemas opening every session (all share it)"),
        ("min_context_tokens", "least final context of a session (log-uniform up to the most)"),
        ("max_context_tokens", "most final context of a session"),
    ):
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=getattr(defaults, name),
            help=f"{what} (default %(default)s)",
        )
    p.add_argument(
        "--start-window",
        type=float,
        default=defaults.start_window_s,
        metavar="S",
        help="sessions start uniformly over this many seconds (default %(default)s)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    shape = AgentShape(
        sessions=args.sessions,
        system_tokens=args.system_tokens,
        min_context_tokens=args.min_context_tokens,
        max_context_tokens=args.max_context_tokens,
        start_window_s=args.start_window,
    )
    rows = agent_rows(shape, args.seed)
    write_rows(rows, args.out)
    prompts = [int(r["input_length"]) for r in rows]  # type: ignore[call-overload]
    print(
        f"{args.out}: {len(rows)} requests, {shape.sessions} sessions, "
        f"prompt mean {sum(prompts) / len(prompts):,.0f} / max {max(prompts):,} tokens, "
        f"span {int(rows[-1]['timestamp']) / 1000:,.0f} s"  # type: ignore[call-overload]
    )
    return 0
