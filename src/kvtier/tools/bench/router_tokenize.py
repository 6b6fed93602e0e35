"""Router tokenization: the router's CPU per chat request to turn it into a prompt for routing.

    kvtier bench router-tokenize --json router_tokenize.json

What it measures: `kvtier.router.tokenizer.Tokenizer.prompt(body, chat=True)`, the work the
router does on its event loop for every chat request before it can hash blocks: the
conversation and tools handed to the model's chat template as vLLM hands them, the template
rendered, and the text encoded in cached chunks (the tail left as text).

Method: one `Tokenizer` of `--model`. For each conversation size of `--messages`, a
deterministic agent-style request (`conversation`: a system and a user message, then cycles of
an assistant tool call, the tool's result and an assistant answer, with 3 tool definitions);
`prompt` once as warm-up, then `--runs` runs of `--requests` calls on the same body, each run
timed with `time.perf_counter` as its mean ms per request. The same body each time hits the
encoder's chunk cache, as the router's does for a conversation whose earlier turns it has seen;
rendering the template is paid in full every time.

Row per size: the median ms per request over the runs and its min-max, the request's message
and tool-call counts, and its prompt's token count (`Tokenizer.request_tokens`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

__all__ = ["TOOLS", "conversation", "measure", "register", "tool_calls"]

SEED = 20261207

Field = tuple[str, str, str]
"""A tool parameter: (name, JSON type, description)."""


def _tool(name: str, description: str, required: Field, optional: Field) -> dict[str, Any]:
    """A function tool in OpenAI's shape, with one required and one optional parameter."""
    properties = {
        field: {"type": kind, "description": text} for field, kind, text in (required, optional)
    }
    parameters = {"type": "object", "properties": properties, "required": [required[0]]}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS: list[dict[str, Any]] = [
    _tool(
        "read_file",
        "Read a text file of the repository and return its contents.",
        ("path", "string", "Path from the repository root."),
        ("max_lines", "integer", "Lines to return at most."),
    ),
    _tool(
        "run_shell",
        "Run a shell command in the repository and return its output.",
        ("command", "string", "The command line."),
        ("timeout_s", "number", "Seconds before it is killed."),
    ),
    _tool(
        "search_code",
        "Search the repository for a regular expression.",
        ("pattern", "string", "A regular expression."),
        ("glob", "string", "Files to search, e.g. *.py."),
    ),
]
"""The tool definitions every request carries (OpenAI shape, JSON-schema parameters)."""

_MODULES = ("router/app", "router/index", "core/keys", "vllm/connector", "tools/cluster")
_NAMES = ("route", "block_hashes", "lookup", "evict", "save_blocks", "load", "refresh")
_TESTS = ("test_routing", "test_eviction", "test_hashes", "test_restart", "test_tokenizer")


def _tool_call(rng: random.Random, index: int) -> tuple[dict[str, Any], str]:
    """One call of a tool of `TOOLS` as an assistant message (with a line of text, as agents
    write), and the result the tool returns: a few hundred characters."""
    module, name = rng.choice(_MODULES), rng.choice(_NAMES)
    tool = ("read_file", "run_shell", "search_code")[index % 3]
    if tool == "read_file":
        arguments: dict[str, Any] = {"path": f"src/kvtier/{module}.py", "max_lines": 40}
        result = "\n".join(
            f"def {name}_{k}(self, blocks: list[int], limit: int = {rng.randint(1, 64)}) -> int:\n"
            f'    """{name.replace("_", " ").capitalize()} up to `limit` blocks."""'
            for k in range(rng.randint(2, 4))
        )
    elif tool == "run_shell":
        test = rng.choice(_TESTS)
        arguments = {
            "command": f"pytest tests/{module.split('/')[0]} -k {test} -q",
            "timeout_s": 120,
        }
        passed = rng.randint(3, 40)
        result = (
            f"{'.' * passed}F\nFAILED tests/{module}.py::{test}_{name} - AssertionError: "
            f"assert {rng.randint(0, 9)} == {rng.randint(10, 99)}\n1 failed, {passed} passed in "
            f"{rng.uniform(0.5, 9):.2f}s"
        )
    else:
        arguments = {"pattern": f"def {name}", "glob": "*.py"}
        result = "\n".join(
            f"src/kvtier/{rng.choice(_MODULES)}.py:{rng.randint(10, 900)}: def {name}(self, ...):"
            for _ in range(rng.randint(2, 5))
        )
    call = {
        "role": "assistant",
        "content": f"Let me look at `{name}` in {module} before changing anything.",
        "tool_calls": [
            {
                "id": f"call_{index:04d}",
                "type": "function",
                "function": {"name": tool, "arguments": json.dumps(arguments)},
            }
        ],
    }
    return call, result


def conversation(messages: int, seed: int = SEED) -> dict[str, Any]:
    """A chat request of exactly `messages` messages (at least 2), the same for the same
    arguments: a system and a user message, then cycles of an assistant message with one tool
    call, the `tool` message answering it (`tool_call_id`) and an assistant text message, cut
    after `messages`. Carries `TOOLS` and a `model`."""
    if messages < 2:
        raise ValueError(f"a conversation has at least 2 messages, got {messages}")
    rng = random.Random(seed)
    turns: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": "You are a coding agent working in the kvtier repository. Use the tools "
            "to read files, search the code and run the tests; explain each change briefly.",
        },
        {
            "role": "user",
            "content": "The router evicts blocks that replicas still hold after a restart. Find "
            "the cause, fix it, and make sure the routing and eviction tests pass.",
        },
    ]
    for index in range(messages // 3):  # ceil((messages - 2) / 3) cycles of 3 messages
        call, result = _tool_call(rng, index)
        answer = (
            f"The output shows {rng.choice(_NAMES)} runs before the replica's events are "
            f"replayed, so {rng.randint(2, 300)} blocks look missing. Next I check "
            f"{rng.choice(_MODULES)}."
        )
        turns += [
            call,
            {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": result},
            {"role": "assistant", "content": answer},
        ]
    return {"model": "kvtier-bench", "messages": turns[:messages], "tools": TOOLS}


def tool_calls(body: dict[str, Any]) -> int:
    """The number of tool calls in a request's messages."""
    return sum(len(m.get("tool_calls") or []) for m in body["messages"])


def measure(
    prompt: Callable[[], object], requests: int, runs: int, ran: Callable[[], object]
) -> list[float]:
    """`prompt()` once as warm-up, then `runs` runs of `requests` calls, `ran()` after each:
    the mean ms per call of each run."""
    prompt()
    means = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(requests):
            prompt()
        means.append((time.perf_counter() - start) * 1000 / requests)
        ran()
    return means


def _sizes(text: str) -> list[int]:
    """`--messages`: a comma list of conversation sizes, each at least 2."""
    try:
        sizes = [int(item) for item in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of message counts of at least 2, got {text!r}"
        )
    return sizes


def _positive(text: str) -> int:
    """A count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _cmd(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.router.tokenizer import Tokenizer
    from kvtier.tools.bench.report import write_json
    from kvtier.tools.embedded_model import resolve_model

    tokenizer = Tokenizer(resolve_model(args.model))
    rows = []
    for size in args.messages:
        body = conversation(size)
        with tqdm(total=args.runs, desc=f"{size} messages", unit="run", file=sys.stderr) as bar:
            means = measure(
                partial(tokenizer.prompt, body, chat=True), args.requests, args.runs, bar.update
            )
        rows.append(
            {
                "messages": size,
                "tool_calls": tool_calls(body),
                "prompt_tokens": len(tokenizer.request_tokens(body, chat=True)),
                "requests": args.requests,
                "runs": args.runs,
                "ms_median": statistics.median(means),
                "ms_min": min(means),
                "ms_max": max(means),
            }
        )
    print(f"{'messages':>8} {'tool calls':>10} {'tokens':>7} {'ms/request':>10} {'min-max':>13}")
    for row in rows:
        print(
            f"{row['messages']:>8} {row['tool_calls']:>10} {row['prompt_tokens']:>7} "
            f"{row['ms_median']:>10.3f} {row['ms_min']:>6.3f}-{row['ms_max']:.3f}"
        )
    if args.json:
        write_json(rows, Path(args.json))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "router-tokenize",
        help="the router's ms per chat request to render and encode it for routing",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--messages",
        type=_sizes,
        default=[7, 121],
        metavar="N,N",
        help="conversation sizes to measure, a comma list of message counts of at least 2 "
        "(default 7,121: 2 and 40 tool calls)",
    )
    p.add_argument(
        "--requests", type=_positive, default=100, help="calls timed per run (default 100)"
    )
    p.add_argument(
        "--runs",
        type=_positive,
        default=15,
        help="runs per size; the row gives their median and min-max (default 15)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="local Hugging Face model directory whose tokenizer and chat template to use "
        "(default: the embedded model)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the rows here (a JSON list)")
    p.set_defaults(func=_cmd)
