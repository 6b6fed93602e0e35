"""`kvtier router`: flags into `RouterSettings` (one flag per setting), then serve until
interrupted."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvtier.core.parent_watch import stop_with_parent
from kvtier.core.settings import add_flags, from_flags
from kvtier.router.settings import RouterSettings, load_replicas_file

__all__ = ["register", "settings_from_args"]

FLAGS = {"replicas": "--replica", "model_dir": "--model"}
"""Flags named other than their setting."""


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """The router's settings from its flags; `--replicas-file` entries follow `--replica`s."""
    replicas: list[object] = list(args.replicas or ())
    if args.replicas_file:
        replicas += load_replicas_file(args.replicas_file)
    given = argparse.Namespace(**{**vars(args), "replicas": replicas or None})
    settings: RouterSettings = from_flags(RouterSettings, given, {"replicas": []}, flags=FLAGS)
    return settings


def without_torch() -> None:
    """Keep torch out of this process from now on: transformers then runs as the tokenizer-only
    library it is where torch is not installed (the router needs nothing else from it), and the
    router starts in a fraction of the time, with a fraction of the memory. Only for a process
    that serves nothing but the router: a later `import torch` in it fails."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the documented import block


def _run(args: argparse.Namespace) -> int:
    stop_with_parent()  # a router `kvtier up` started stops should `kvtier up` die first
    from kvtier.net.http_server import fast_loop_factory
    from kvtier.router.app import Router, serve  # transformers: only when serving
    from kvtier.tools.embedded_model import resolve_model

    settings = settings_from_args(args)
    settings = settings.replaced(model_dir=resolve_model(settings.model_dir))
    if args.own_process:  # after resolve_model, which may convert the model with torch
        without_torch()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        with asyncio.Runner(loop_factory=fast_loop_factory()) as runner:
            runner.run(serve(Router(settings)))
    except KeyboardInterrupt:
        pass
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "router",
        help="run the KV-aware OpenAI-compatible router in front of vLLM replicas",
        description="An asynchronous OpenAI-compatible proxy (/v1/completions, "
        "/v1/chat/completions with SSE streaming, /v1/models, /health, /metrics) "
        "that sends each request to the replica most likely to hold its prompt's "
        "KV cache, weighed against load; fails over before the first byte.",
        epilog="Every flag is a router setting (docs/router.md lists them). kvaware follows "
        "the replicas' KV events: kvtier connector events via --events, vLLM's own via "
        "--replica URL=ENDPOINT.",
    )
    add_flags(
        p,
        RouterSettings,
        flags=FLAGS,
        metavars={"replicas": "URL[=VLLM_EVENTS]", "events": "ENDPOINT", "model_dir": "DIR"},
    )
    p.add_argument(
        "--replicas-file",
        metavar="FILE",
        help="YAML/JSON list of replica URLs or {url, name, vllm_events, vllm_events_replay} "
        "objects",
    )
    p.set_defaults(func=_run)
