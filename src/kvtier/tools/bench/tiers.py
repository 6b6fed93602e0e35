"""S1 `kvtier bench tiers`: TTFT of a prompt served cold, from L0, from L1 and from another
replica's L2, for kvtier and its peers, side by side in one run.

    kvtier bench tiers --lengths 512,1024,2500,4000 --runs 3 --json s1.json

Servers (all `vllm serve` on the same model, pinned to the same cores with the same thread
count, started through `kvtier.tools.vllm_server`, one at a time: an idle engine still polls and
would steal the core of the one being measured):
- `kvtier` A and B: the connector, one shared L2 directory;
- `vllm-prefix`: plain vLLM (its prefix cache is the L0 baseline);
- peers, each tried and recorded with the exact error when it cannot run here:
  `vllm-offload` (`--kv-offloading-size`), `vllm-offload-fs` (its tiering with an `fs` tier
  shared by two servers), `lmcache` (`--kv-offloading-backend lmcache`).

For every length and run a fresh document of exactly that many tokens (real text, see
`kvtier.tools.bench.corpus`) is sent with max_tokens=1 and streamed; TTFT is the time to the first
token. Per prompt: cold on A, again on A (L0 hit), after emptying A's L0 through vLLM's
`/reset_prefix_cache` (L1 hit); then, A stopped, on B, which never saw it (L2 hit). Rows carry
the median and every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError
from kvtier.net.ports import free_port
from kvtier.router.health import engine_block_tokens
from kvtier.tools.bench.client import call
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config

GIB = 1024**3
SCENARIOS = ("cold", "l0", "l1", "l2_cross")


@dataclass(slots=True)
class Row:
    system: str
    tokens: int
    scenario: str
    runs: list[float] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "system": self.system,
            "tokens": self.tokens,
            "scenario": self.scenario,
        }
        if self.error is not None:
            row["error"] = self.error
        else:
            row["ttft_ms"] = round(statistics.median(self.runs), 2)
            row["runs"] = [round(r, 2) for r in self.runs]
        return row


def prompt_ids(corpus: Any, n_tokens: int, seed: int) -> list[int]:
    """Exactly `n_tokens` token ids of stdlib docstring text; seeds give distinct prefixes."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += corpus.encode(rng.choice(corpus._paras) + "\n\n")
    return ids[:n_tokens]


def ttft_ms(url: str, model: str, tokens: Sequence[int], timeout_s: float = 600.0) -> float:
    """Stream one greedy completion of one token; milliseconds until its first chunk."""
    from kvtier.tools.bench.client import new_pool, stream_request

    async def once() -> float:
        pool = new_pool(timeout_s)
        try:
            outcome = await stream_request(
                pool,
                url,
                {"model": model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0.0},
                timeout_s,
            )
        finally:
            pool.close()
        return outcome.ttft_ms

    return asyncio.run(once())


def reset_l0(url: str, attempts: int = 50) -> None:
    """Empty vLLM's prefix cache (dev-mode endpoint); retried while blocks are still held."""

    for _ in range(attempts):
        status, body = call(url, "/reset_prefix_cache", {})
        if status != 200:
            raise KvtierError(f"{url}/reset_prefix_cache: HTTP {status}")
        if json.loads(body or b"{}").get("success", True):
            return
        time.sleep(0.2)
    raise KvtierError(f"{url}: prefix cache still busy after {attempts} resets")


def wait_for_l2(
    l2_dir: Path, tokens: Sequence[int], block_tokens: int, timeout_s: float = 120.0
) -> None:
    """Block until every full kvtier block of `tokens` is published in L2 (write-through is
    asynchronous: the cross-replica scenario must not race it)."""
    from kvtier.core.keys import block_hashes

    names = {f"{h.hex()}.kvt" for h in block_hashes(list(tokens), block_tokens)}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        present = {p.name for p in l2_dir.rglob("*.kvt")}
        if names <= present:
            return
        time.sleep(0.1)
    raise KvtierError(f"L2 write-through of {len(names)} blocks not done after {timeout_s} s")


def failure_reason(log_path: Path) -> str:
    """The root-cause exception line of a server that did not start (its first one)."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    errors = [
        re.sub(r"^.*?\] ", "", ln).strip()
        for ln in lines
        if re.search(r"\b\w*(Error|Exception): ", ln) and "WARNING" not in ln
    ]
    return (errors or lines[-1:] or ["no output"])[0][:500]


class Bench:
    """Owns the servers of one run; `close()` stops them all."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        from kvtier.tools.bench.corpus import Corpus
        from kvtier.tools.embedded_model import resolve_model

        self.args = args
        self.model = resolve_model(args.model)
        self.name = Path(self.model).name
        self.corpus = Corpus(AutoTokenizer.from_pretrained(self.model))
        self.work = Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-"))
        self.l2_dir = Path(args.l2_path) if args.l2_path else self.work / "l2"
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[Any] = []
        self.rows: dict[tuple[str, int, str], Row] = {}

    def start(self, label: str, transfer: dict[str, Any] | None, extra: Sequence[str] = ()) -> Any:
        from kvtier.tools.vllm_server import ServerSpec, start_server

        spec = ServerSpec(
            model=self.model,
            port=free_port(),
            kv_transfer_config=transfer,
            kv_cache_gib=self.args.kv_cache_gib,
            max_model_len=max(self.args.lengths) + 64,
            threads=self.args.threads,
            cpu_ids=self.args.cpu_ids,
            extra_args=list(extra),
            env={"VLLM_SERVER_DEV_MODE": "1"},
            log_path=self.work / f"{label}.log",
        )
        server = start_server(spec, timeout_s=900)
        self.servers.append(server)
        ttft_ms(server.url, self.name, prompt_ids(self.corpus, 300, seed=hash(label) % 10**6))
        return server

    def try_start(
        self, label: str, transfer: dict[str, Any] | None, extra: Sequence[str] = ()
    ) -> tuple[Any, str | None]:
        try:
            return self.start(label, transfer, extra), None
        except KvtierError:
            return None, failure_reason(self.work / f"{label}.log")

    def prompts(self, length: int) -> list[list[int]]:
        return [
            prompt_ids(self.corpus, length, seed=length * 1000 + i) for i in range(self.args.runs)
        ]

    def measure(self, system: str, scenarios: dict[str, Callable[[list[int]], float]]) -> None:
        """Run the scenarios in order on every run's prompt of every length."""
        for length in self.args.lengths:
            for tokens in self.prompts(length):
                for scenario, fn in scenarios.items():
                    key = (system, length, scenario)
                    self.rows.setdefault(key, Row(system, length, scenario)).runs.append(fn(tokens))
            for scenario in scenarios:
                print(json.dumps(self.rows[system, length, scenario].as_dict()), flush=True)

    def measure_local(self, system: str, url: str) -> None:
        """Cold, then L0 hit, then (vLLM's prefix cache emptied) L1 hit, on one server."""

        def l1(tokens: list[int]) -> float:
            reset_l0(url)
            return ttft_ms(url, self.name, tokens)

        self.measure(
            system,
            {
                "cold": lambda t: ttft_ms(url, self.name, t),
                "l0": lambda t: ttft_ms(url, self.name, t),
                "l1": l1,
            },
        )

    def errors(self, system: str, scenarios: Sequence[str], reason: str) -> None:
        print(f"kvtier bench tiers: {system} cannot run here: {reason}", flush=True)
        for length in self.args.lengths:
            for s in scenarios:
                self.rows[system, length, s] = Row(system, length, s, error=reason)

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []


def _kvtier(
    bench: Bench, system: str = "kvtier", l2_a: Path | None = None, l2_b: Path | None = None
) -> None:
    """Replica A measures cold/L0/L1 with L2 at `l2_a`; replica B, started after A stopped,
    measures L2 hits reading `l2_b` (the same directory, or another mount of one volume)."""
    l2_a = l2_a or bench.l2_dir
    l2_b = l2_b or l2_a

    def transfer_for(l2: Path) -> dict[str, Any]:
        return kv_transfer_config(
            ConnectorSettings(
                l1_bytes=int(bench.args.l1_gib * GIB),
                l2_path=str(l2),
                block_tokens=bench.args.block_tokens,
            )
        )

    a = bench.start(f"{system}-a", transfer_for(l2_a))
    bench.measure_local(system, a.url)
    block_tokens = bench.args.block_tokens or engine_block_tokens(call(a.url, "/metrics")[1])
    for length in bench.args.lengths:
        for tokens in bench.prompts(length):
            wait_for_l2(l2_b, tokens, block_tokens or 0)
    bench.close()  # one server at a time: an idle engine still polls and steals the core
    b = bench.start(f"{system}-b", transfer_for(l2_b))
    bench.measure(system, {"l2_cross": lambda t: ttft_ms(b.url, bench.name, t)})


def _kvtier_juicefs(bench: Bench) -> None:
    """The kvtier rows again with L2 on a JuiceFS volume, A and B on two mounts (two nodes)."""
    from kvtier.tools.l2ops.juicefs import JuiceFSVolume, JuiceFSVolumeSpec

    with JuiceFSVolume(JuiceFSVolumeSpec(root=str(bench.work / "juicefs"))) as volume:
        first, second = volume.mount(), volume.mount()
        try:
            _kvtier(bench, "kvtier-juicefs", Path(first.path), Path(second.path))
        finally:
            bench.close()  # engines must let go of the mounts before they unmount


def _vllm_prefix(bench: Bench) -> None:
    server = bench.start("vllm-prefix", None)
    bench.measure(
        "vllm-prefix",
        {
            "cold": lambda t: ttft_ms(server.url, bench.name, t),
            "l0": lambda t: ttft_ms(server.url, bench.name, t),
        },
    )


def _peer(
    bench: Bench,
    system: str,
    transfer: dict[str, Any] | None,
    extra: Sequence[str],
    two_servers: bool,
) -> None:
    """A peer with an L1 (and, with `two_servers`, a shared tier): measured, or its error."""
    scenarios = ["cold", "l0", "l1"] + (["l2_cross"] if two_servers else [])
    a, reason = bench.try_start(f"{system}-a", transfer, extra)
    if a is None:
        bench.errors(system, scenarios, reason or "did not start")
        return
    bench.measure_local(system, a.url)
    bench.close()
    if two_servers:
        b, reason = bench.try_start(f"{system}-b", transfer, extra)
        if b is None:
            bench.errors(system, ["l2_cross"], reason or "did not start")
            return
        bench.measure(system, {"l2_cross": lambda t: ttft_ms(b.url, bench.name, t)})
        bench.close()


def _peers(bench: Bench) -> None:
    size = str(int(bench.args.l1_gib))
    _peer(bench, "vllm-offload", None, ["--kv-offloading-size", size], two_servers=False)
    fs_root = bench.work / "vllm-fs"
    fs_root.mkdir()
    tiering = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(bench.args.l1_gib * GIB),
            "secondary_tiers": [{"type": "fs", "root_dir": str(fs_root)}],
        },
    }
    _peer(bench, "vllm-offload-fs", tiering, [], two_servers=True)
    _peer(
        bench,
        "lmcache",
        None,
        ["--kv-offloading-size", size, "--kv-offloading-backend", "lmcache"],
        two_servers=False,
    )


def _run(args: argparse.Namespace) -> int:
    args.lengths = [int(x) for x in args.lengths.split(",")]
    bench = Bench(args)
    try:
        _kvtier(bench)
        bench.close()  # free the cores before the next system
        if args.juicefs:
            _kvtier_juicefs(bench)
        _vllm_prefix(bench)
        bench.close()
        if not args.skip_peers:
            _peers(bench)
    finally:
        bench.close()
        if not args.l2_path:
            shutil.rmtree(bench.l2_dir, ignore_errors=True)  # GBs of blocks; logs are kept
    rows = [r.as_dict() for r in bench.rows.values()]
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"kvtier bench tiers: {len(rows)} rows -> {args.json} (server logs: {bench.work})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "tiers",
        help="S1: TTFT cold / L0 / L1 / cross-replica L2, kvtier vs peers",
        description="Measure time to first token of prompts served cold, from vLLM's prefix "
        "cache (L0), from kvtier's L1 after L0 was emptied, and from L2 on a "
        "second replica, beside plain vLLM and vLLM's native offloading and "
        "LMCache (recorded with their error where they cannot run).",
    )
    p.add_argument(
        "--lengths",
        default="512,1024,2500,4000",
        help="prompt lengths in tokens, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--runs", type=int, default=3, help="distinct prompts per length; rows report the median"
    )
    p.add_argument("--json", required=True, help="write the rows here")
    p.add_argument("--model", help="local HF model directory (default: the embedded model)")
    p.add_argument("--l2-path", help="shared L2 directory (default: a fresh temp directory)")
    p.add_argument(
        "--l1-gib",
        type=float,
        default=2.0,
        help="L1 budget of kvtier and of the offloading peers (default: 2)",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        help="kvtier block size in tokens (default: the engine's block size)",
    )
    p.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's own KV cache (L0)")
    p.add_argument("--threads", type=int, default=1, help="engine threads of every server")
    p.add_argument(
        "--cpu-ids", default="1", help="cores every server is pinned to (default: %(default)s)"
    )
    p.add_argument(
        "--juicefs",
        action="store_true",
        help="also measure kvtier with L2 on a JuiceFS volume (system "
        "'kvtier-juicefs'): replica A writes through one FUSE mount, replica B "
        "reads through a second mount of the same volume",
    )
    p.add_argument("--skip-peers", action="store_true", help="measure only kvtier and plain vLLM")
    p.set_defaults(func=_run)
