"""`kvtier router`: flags into a `RouterConfig`, then serve until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

from kvtier.core.errors import ConfigError
from kvtier.router.settings import ReplicaConfig, RouterConfig, load_replicas_file

__all__ = ["fast_loop_factory", "register"]

_STRATEGIES = ("prefixaware", "kvaware", "session", "roundrobin", "leastload")


def _replica_arg(value: str) -> ReplicaConfig:
    """URL or URL=VLLM_EVENTS_ENDPOINT."""
    url, _, events = value.partition("=")
    return ReplicaConfig(url, vllm_events=events or None)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    replicas: list[ReplicaConfig] = [_replica_arg(v) for v in args.replica or ()]
    if args.replicas_file:
        replicas += load_replicas_file(args.replicas_file)
    if not replicas:
        raise ConfigError("replicas: give --replica URL (repeatable) or --replicas-file FILE")
    return RouterConfig(
        replicas=tuple(replicas), strategy=args.strategy, host=args.host, port=args.port,
        api_key=args.api_key, model_dir=args.model, block_tokens=args.block_tokens,
        max_model_len=args.max_model_len, events=tuple(args.events or ()),
        session_header=args.session_header, max_blocks=args.max_blocks,
        health_interval_s=args.health_interval, seed=args.seed)


def fast_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory when present (faster; a vLLM dependency), else None."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _run(args: argparse.Namespace) -> int:
    from kvtier.router.app import Router, serve  # uvicorn and transformers: only when serving

    config = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        with asyncio.Runner(loop_factory=fast_loop_factory()) as runner:
            runner.run(serve(Router(config)))
    except KeyboardInterrupt:
        pass
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "router", help="run the KV-aware OpenAI-compatible router in front of vLLM replicas",
        description="An asynchronous OpenAI-compatible proxy (/v1/completions, "
                    "/v1/chat/completions with SSE streaming, /v1/models, /health, /metrics) "
                    "that sends each request to the replica most likely to hold its prompt's "
                    "KV cache, weighed against load; fails over before the first byte.",
        epilog="Strategies: prefixaware (default) remembers what it routed; kvaware follows "
               "the replicas' KV events (kvtier connector via --events, vLLM's own via "
               "--replica URL=ENDPOINT); session sticks on --session-header or the body's "
               "'user'; roundrobin and leastload ignore the cache. See docs/router.md.")
    p.add_argument("--replica", action="append", metavar="URL[=VLLM_EVENTS]",
                   help="replica base URL, e.g. http://127.0.0.1:8001 (repeatable); append "
                        "=tcp://HOST:PORT for its vLLM KV-event publisher (kvaware L0)")
    p.add_argument("--replicas-file", metavar="FILE",
                   help="YAML/JSON list of replica URLs or {url, name, vllm_events} objects")
    p.add_argument("--strategy", choices=_STRATEGIES, default="prefixaware",
                   help="routing strategy (default: prefixaware)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--model", metavar="DIR",
                   help="local HF model dir for the tokenizer and chat template "
                        "(default: the embedded model)")
    p.add_argument("--block-tokens", type=int, default=128,
                   help="engine KV block size in tokens, for prefix hashing (default 128, "
                        "vLLM CPU)")
    p.add_argument("--max-model-len", type=int,
                   help="reject longer prompts with 400 (default: from the replicas' /v1/models)")
    p.add_argument("--events", nargs="+", action="extend", metavar="ENDPOINT",
                   help="ZMQ endpoints of kvtier connector KV events (kvaware)")
    p.add_argument("--session-header", default="x-session-id",
                   help="header naming a sticky session (session strategy)")
    p.add_argument("--max-blocks", type=int, default=1_000_000,
                   help="bound of each prefix index in (replica, block) entries")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health checks of each replica (default 1)")
    p.add_argument("--seed", type=int, help="seed the tie-breaking random generator")
    p.set_defaults(func=_run)
