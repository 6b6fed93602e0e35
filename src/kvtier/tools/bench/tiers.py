"""S1 `kvtier bench tiers`: TTFT of a prompt served cold, from L0, from L1 and from another
replica's L2 (a local directory, JuiceFS mounts, Valkey), for kvtier and plain vLLM, side by side in
one run, with the spread of the runs and, with `--breakdown`, where an L1 and an L2 hit's time
goes.

    kvtier bench tiers --lengths 512,1024,2500,4000 --runs 5 --juicefs --breakdown --json s1.json

Servers (all `vllm serve` on the same model, pinned to the same cores with the same thread
count, started through `kvtier.tools.vllm_server`), all up at once, and every one not being
measured frozen (SIGSTOP of its process group: an idle engine still polls and would steal the
core of the one being measured):
- `kvtier` A: the connector with L2 in a directory; serves cold, L0 and L1;
- `kvtier` B: a second replica on the same directory that never computes a prompt (L2 hits);
- `kvtier-juicefs`: a replica reading L2 through a mount of its own of a JuiceFS volume
  (metadata in a Valkey server, objects in a local directory) whose first mount received A's
  blocks (copied file by file: the same bytes A wrote), so every hit crosses FUSE, JuiceFS's
  client and its object store, as on another node; it runs the `juicefs` L2 profile, as a
  user on JuiceFS would;
- `kvtier-valkey` (`--valkey`): a replica whose L2 is a loopback Valkey server holding A's blocks
  (each file's bytes as the value of its key: what A would have stored there);
- `kvtier-NAME` for each `--variant NAME:key=value,...`: another L2 reader with those connector
  settings (e.g. the data path before this release, to compare in the same run); with
  `l2=juicefs`, on a JuiceFS mount of its own, with the `juicefs` profile unless the variant
  names another;
- `vllm-prefix`: plain vLLM (its prefix cache is the L0 baseline).
Peers (vLLM's native offloading, LMCache) are tried afterwards, one at a time, and recorded with
the exact error when they cannot run here.

Order: runs go round by round; in each, every length gets a fresh document of exactly that many
tokens (real text, `kvtier.tools.bench.corpus`), sent with max_tokens=1 and streamed (TTFT =
time to the first streamed token): cold on A and on plain vLLM, then L0 on both (which of the
two goes first alternates from run to run), L1 on A after emptying its L0 through vLLM's
`/reset_prefix_cache`, then the L2 hits on every reader (in an order that rotates), each reader
but B followed by its own L1 hit (the blocks it just loaded reach its L1). So slow
drifts of a shared machine hit every system alike, and each ratio is taken within one prompt
(paired); rows report the median and the min-max of the runs, ratios the median and min-max
of the paired ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError, run_every
from kvtier.core.tiers.posix import SUFFIX
from kvtier.net.ports import free_port
from kvtier.router.health import engine_block_tokens
from kvtier.tools.bench.client import call
from kvtier.tools.bench.tiers_breakdown import (
    PHASES,
    Breakdown,
    breakdown_rows,
    breakdown_table,
    save_cpu,
    scrape,
    write_chart,
)
from kvtier.vllm.settings import ConnectorSettings, kv_transfer_config

GIB = 1024**3
SCENARIOS = ("cold", "l0", "l1", "l2_cross")
PLAIN = "vllm-prefix"
RATIOS = (
    ("kvtier cold / vLLM cold", ("kvtier", "cold"), (PLAIN, "cold")),
    ("kvtier L1 / vLLM L0", ("kvtier", "l1"), (PLAIN, "l0")),
    ("kvtier L2 / vLLM L0", ("kvtier", "l2_cross"), (PLAIN, "l0")),
    ("kvtier L2 / kvtier L0", ("kvtier", "l2_cross"), ("kvtier", "l0")),
    ("vLLM cold / kvtier L2", (PLAIN, "cold"), ("kvtier", "l2_cross")),
)
"""Paired ratios reported for kvtier; every other L2 reader gets its "L2 / vLLM L0" and
"L1 / vLLM L0" too."""


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
            row["min_ms"] = round(min(self.runs), 2)
            row["max_ms"] = round(max(self.runs), 2)
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
    import asyncio

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


def block_files(l2_dir: Path, tokens: Sequence[int], block_tokens: int) -> list[Path]:
    """Paths (relative to `l2_dir`) of the L2 files of every full kvtier block of `tokens`."""
    from kvtier.core.keys import block_hashes

    names = [h.hex() for h in block_hashes(list(tokens), block_tokens)]
    namespaces = [p.name for p in l2_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if len(namespaces) != 1:
        raise KvtierError(f"{l2_dir}: expected one namespace directory, found {namespaces}")
    return [Path(namespaces[0], h[0:2], h[2:4], h + SUFFIX) for h in names]


def wait_for_l2(
    l2_dir: Path, tokens: Sequence[int], block_tokens: int, timeout_s: float = 120.0
) -> list[Path]:
    """Block until every full kvtier block of `tokens` is published in L2 (write-through is
    asynchronous: the cross-replica scenario must not race it); returns their paths."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            files = block_files(l2_dir, tokens, block_tokens)
            if all((l2_dir / f).is_file() for f in files):
                return files
        except KvtierError:
            pass  # the namespace directory is not there yet
        time.sleep(0.05)
    raise KvtierError(
        f"L2 write-through of a {len(tokens)}-token prompt not done after {timeout_s} s"
    )


def copy_blocks(src_root: Path, dst_root: Path, files: Sequence[Path]) -> None:
    """Publish `files` under `dst_root` as a writer would: a temp name, then a rename."""
    for rel in files:
        dst = dst_root / rel
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.{os.getpid()}.copy.tmp")
        shutil.copyfile(src_root / rel, tmp)
        os.rename(tmp, dst)


def copy_blocks_to_valkey(src_root: Path, url: str, files: Sequence[Path]) -> None:
    """Store `files` (`<namespace>/../<hash>.kvt` under `src_root`) in the Valkey server at `url`
    as the Valkey tier names and stores blocks: `<namespace>:<hash>`, the file's bytes, if
    absent."""
    import valkey

    from kvtier.core.tiers.valkey import set_if_absent

    with valkey.Valkey.from_url(url) as client:
        for rel in files:
            key = f"{rel.parts[0]}:{rel.name.removesuffix(SUFFIX)}"
            set_if_absent(client, key, [(src_root / rel).read_bytes()])


def failure_reason(log_path: Path) -> str:
    """The root-cause exception line of a server that did not start (its first one)."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    errors = [
        re.sub(r"^.*?\] ", "", ln).strip()
        for ln in lines
        if re.search(r"\b\w*(Error|Exception): ", ln) and "WARNING" not in ln
    ]
    return (errors or lines[-1:] or ["no output"])[0][:500]


def paired_ratios(
    rows: dict[tuple[str, int, str], Row], l2_systems: Sequence[str]
) -> list[dict[str, Any]]:
    """Median and min-max of per-prompt ratios (both TTFTs of one prompt, taken close in time)."""
    specs = list(RATIOS) + [
        spec
        for s in l2_systems
        if s != "kvtier"
        for spec in (
            (f"{s} L2 / vLLM L0", (s, "l2_cross"), (PLAIN, "l0")),
            (f"{s} L1 / vLLM L0", (s, "l1"), (PLAIN, "l0")),
        )
    ]
    out: list[dict[str, Any]] = []
    for tokens in sorted({t for _, t, _ in rows}):
        for name, (sa, ca), (sb, cb) in specs:
            a, b = rows.get((sa, tokens, ca)), rows.get((sb, tokens, cb))
            if a is None or b is None or a.error or b.error or len(a.runs) != len(b.runs):
                continue
            ratios = [x / y for x, y in zip(a.runs, b.runs, strict=True)]
            out.append(
                {
                    "ratio": name,
                    "tokens": tokens,
                    "median": round(statistics.median(ratios), 3),
                    "min": round(min(ratios), 3),
                    "max": round(max(ratios), 3),
                    "runs": [round(r, 3) for r in ratios],
                }
            )
    return out


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
        self.servers: dict[str, Any] = {}
        self.frozen: set[str] = set()
        self.rows: dict[tuple[str, int, str], Row] = {}
        self.breakdowns: list[Breakdown] = []
        self.save_cpu: dict[str, float] = {}

    def start(self, label: str, transfer: dict[str, Any] | None, extra: Sequence[str] = ()) -> Any:
        """Start a server, warm it up, and freeze it until `use(label)`."""
        from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerSpec, start_server

        spec = ServerSpec(
            model=self.model,
            port=free_port(),
            kv_transfer_config=transfer,
            kv_cache_gib=self.args.kv_cache_gib,
            max_model_len=max(self.args.lengths) + 64,
            threads=self.args.threads,
            cpu_ids=self.args.cpu_ids,
            queue_wait=SHARED_MACHINE_WAIT if self.args.queue_wait == "shared" else None,
            extra_args=list(extra),
            env={"VLLM_SERVER_DEV_MODE": "1"},
            log_path=self.work / f"{label}.log",
        )
        server = start_server(spec, timeout_s=900)
        self.servers[label] = server
        ttft_ms(server.url, self.name, prompt_ids(self.corpus, 300, seed=len(self.servers)))
        self._signal(label, signal.SIGSTOP)
        return server

    def try_start(
        self, label: str, transfer: dict[str, Any] | None, extra: Sequence[str] = ()
    ) -> tuple[Any, str | None]:
        try:
            return self.start(label, transfer, extra), None
        except KvtierError:
            return None, failure_reason(self.work / f"{label}.log")

    @contextmanager
    def use(self, label: str) -> Iterator[str]:
        """Thaw one server (every other one stays frozen) and yield its URL."""
        for other in list(self.servers):
            if other != label and other not in self.frozen:
                self._signal(other, signal.SIGSTOP)
        self._signal(label, signal.SIGCONT)
        try:
            yield self.servers[label].url
        finally:
            self._signal(label, signal.SIGSTOP)

    def _signal(self, label: str, sig: int) -> None:
        try:
            os.killpg(self.servers[label].pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGSTOP:
            self.frozen.add(label)
        else:
            self.frozen.discard(label)

    def prompts(self, length: int) -> list[list[int]]:
        return [
            prompt_ids(self.corpus, length, seed=length * 1000 + i) for i in range(self.args.runs)
        ]

    def record(self, system: str, tokens: int, scenario: str, ms: float) -> None:
        self.rows.setdefault((system, tokens, scenario), Row(system, tokens, scenario)).runs.append(
            ms
        )

    def measure(self, system: str, scenarios: dict[str, Callable[[list[int]], float]]) -> None:
        """Run the scenarios in order on every run's prompt of every length (peers)."""
        for length in self.args.lengths:
            for tokens in self.prompts(length):
                for scenario, fn in scenarios.items():
                    self.record(system, length, scenario, fn(tokens))
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
        """Thaw every server (a stopped process acts on no signal, nor on its owner's death),
        then stop each, even when stopping one before it failed or was interrupted; the first
        exception met is raised once all were stopped."""
        for label in self.servers:
            self._signal(label, signal.SIGCONT)
        servers, self.servers, self.frozen = self.servers, {}, set()
        run_every(server.stop for server in servers.values())


def _transfer(bench: Bench, l2: Path | None, **settings: Any) -> dict[str, Any]:
    """A replica's connector settings: L2 in the directory `l2`, or where `settings` say."""
    where = {} if l2 is None else {"l2_path": str(l2)}
    return kv_transfer_config(
        ConnectorSettings(
            l1_bytes=int(bench.args.l1_gib * GIB),
            block_tokens=bench.args.block_tokens,
            **where,
            **settings,
        )
    )


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """`NAME:key=value,...` -> (NAME, connector settings), checked against `ConnectorSettings`;
    the key `l2=juicefs` (needs `--juicefs`) makes the variant read through the JuiceFS mount
    instead of the directory."""
    name, _, body = text.partition(":")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise argparse.ArgumentTypeError(f"variant name {name!r}: lower-case letters, digits, -")
    settings: dict[str, Any] = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"variant {name}: expected key=value, got {item!r}")
        settings[key.strip()] = value.strip()
    if settings.get("l2", "dir") not in ("dir", "juicefs"):
        raise argparse.ArgumentTypeError(f"variant {name}: l2 must be dir or juicefs")
    try:
        ConnectorSettings.from_mapping({k: v for k, v in settings.items() if k != "l2"})
    except KvtierError as exc:
        raise argparse.ArgumentTypeError(f"variant {name}: {exc}") from None
    return name, settings


class _S1:
    """The side-by-side run (see the module docstring)."""

    def __init__(
        self, bench: Bench, jfs_mount: Callable[[], Path] | None, valkey_url: str | None
    ) -> None:
        """`jfs_mount` mounts the JuiceFS volume once more: the first mount is A's (its blocks
        are copied in there), every reader gets one of its own, as on a node of its own (two
        readers on one mount would share its page cache and JuiceFS's block cache).
        `valkey_url`: the server of `kvtier-valkey`."""
        self.bench = bench
        self.jfs_mount = jfs_mount
        self.valkey_url = valkey_url
        self.jfs_writer = jfs_mount() if jfs_mount is not None else None
        self.readers: dict[str, str] = {"kvtier": "kvtier-b"}
        """L2-reading system -> its server label."""
        self.block_tokens = bench.args.block_tokens

    def start(self) -> None:
        b = self.bench
        b.start("vllm-prefix", None)
        b.start("kvtier-a", _transfer(b, b.l2_dir))
        if not self.block_tokens:
            with b.use("kvtier-a") as url:
                self.block_tokens = engine_block_tokens(call(url, "/metrics")[1]) or 0
        b.start("kvtier-b", _transfer(b, b.l2_dir))
        if self.jfs_mount is not None:
            b.start("kvtier-juicefs", _transfer(b, self.jfs_mount(), l2_profile="juicefs"))
            self.readers["kvtier-juicefs"] = "kvtier-juicefs"
        if self.valkey_url is not None:
            b.start("kvtier-valkey", _transfer(b, None, l2_url=self.valkey_url))
            self.readers["kvtier-valkey"] = "kvtier-valkey"
        for name, variant in b.args.variant or ():
            settings = dict(variant)
            on_juicefs = settings.pop("l2", "dir") == "juicefs"
            if on_juicefs and self.jfs_mount is None:
                raise KvtierError(f"variant {name}: l2=juicefs needs --juicefs")
            label = f"kvtier-{name}"
            if on_juicefs and self.jfs_mount is not None:
                l2 = self.jfs_mount()
                settings.setdefault("l2_profile", "juicefs")
            else:
                l2 = b.l2_dir
            b.start(label, _transfer(b, l2, **settings))
            self.readers[label] = label

    def run(self) -> None:
        b = self.bench
        lengths = list(b.args.lengths)
        prompts = {n: b.prompts(n) for n in lengths}
        with b.use("kvtier-a") as url:
            before = scrape(url)
        for r in range(b.args.runs):
            order = lengths[r % len(lengths) :] + lengths[: r % len(lengths)]
            for n in order:
                self.one_prompt(prompts[n][r], r)
            print(f"kvtier bench tiers: run {r + 1}/{b.args.runs} done", flush=True)
        with b.use("kvtier-a") as url:
            ttft_ms(url, b.name, prompts[lengths[0]][0][:64])  # a step: the last stats arrive
            after = scrape(url)
        b.save_cpu = save_cpu(before, after)

    def one_prompt(self, tokens: list[int], r: int) -> None:
        b, n = self.bench, len(tokens)
        pair = [("kvtier", "kvtier-a"), (PLAIN, "vllm-prefix")]
        if r % 2:
            pair.reverse()
        files: list[Path] = []
        for system, label in pair:  # cold
            with b.use(label) as url:
                b.record(system, n, "cold", ttft_ms(url, b.name, tokens))
                if label == "kvtier-a":  # its write-through finishes before it is frozen
                    files = wait_for_l2(b.l2_dir, tokens, self.block_tokens)
                    time.sleep(0.2)
        for system, label in pair:  # L0
            with b.use(label) as url:
                b.record(system, n, "l0", ttft_ms(url, b.name, tokens))
        with b.use("kvtier-a") as url:  # L1
            reset_l0(url)
            self.hit(url, "kvtier", n, "l1", tokens)
        if self.valkey_url is not None:
            copy_blocks_to_valkey(b.l2_dir, self.valkey_url, files)
        if self.jfs_writer is not None:
            copy_blocks(b.l2_dir, self.jfs_writer, files)
            time.sleep(1.2)  # the other mount's attribute and entry caches (1 s)
        readers = list(self.readers.items())
        for system, label in readers[r % len(readers) :] + readers[: r % len(readers)]:
            with b.use(label) as url:
                self.hit(url, system, n, "l2_cross", tokens)
                # the replica copies the loaded blocks into its L1 in the background: let it
                # finish before it is frozen, so it never runs during another measurement
                time.sleep(0.3 + 0.01 * len(files))
                if system != "kvtier":  # the reader's own L1 hit (its connector settings)
                    reset_l0(url)
                    self.hit(url, system, n, "l1", tokens)

    def hit(self, url: str, system: str, n: int, scenario: str, tokens: list[int]) -> None:
        """Time one cache hit; with `--breakdown`, split it (an L1 hit as system "X L1")."""
        b = self.bench
        before = scrape(url) if b.args.breakdown else None
        ms = ttft_ms(url, b.name, tokens)
        b.record(system, n, scenario, ms)
        if before is not None:
            label = f"{system} L1" if scenario == "l1" else system
            b.breakdowns.append(Breakdown.measure(label, n, ms, url, before))


def _kvtier(bench: Bench) -> list[str]:
    """The side-by-side run; returns the L2-reading systems."""
    from kvtier.tools.l2ops.valkey_server import ValkeyServerSpec, start_valkey

    with contextlib.ExitStack() as stack:
        jfs_mount: Callable[[], Path] | None = None
        if bench.args.juicefs:
            from kvtier.tools.l2ops.juicefs import JuiceFSVolume, JuiceFSVolumeSpec

            # Metadata in Valkey, as a multi-node volume keeps it (SQLite serialises two mounts).
            meta = ValkeyServerSpec(maxmemory_bytes=0, data_dir=str(bench.work / "juicefs-meta"))
            server = stack.enter_context(start_valkey(meta))
            volume = stack.enter_context(
                JuiceFSVolume(
                    JuiceFSVolumeSpec(root=str(bench.work / "juicefs"), meta_url=server.url + "/1")
                )
            )

            def jfs_mount() -> Path:
                return Path(volume.mount().path)

        valkey_url = None
        if bench.args.valkey:
            l2_server = stack.enter_context(start_valkey(ValkeyServerSpec(maxmemory_bytes=0)))
            valkey_url = l2_server.url
        stack.callback(bench.close)  # first: engines let go of the mounts before they unmount
        s1 = _S1(bench, jfs_mount, valkey_url)
        s1.start()
        s1.run()
        return list(s1.readers)


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
    with bench.use(f"{system}-a") as url:
        bench.measure_local(system, url)
    bench.close()
    if two_servers:
        b, reason = bench.try_start(f"{system}-b", transfer, extra)
        if b is None:
            bench.errors(system, ["l2_cross"], reason or "did not start")
            return
        with bench.use(f"{system}-b") as url:
            bench.measure(system, {"l2_cross": lambda t: ttft_ms(url, bench.name, t)})
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


def _print_summary(bench: Bench, ratios: list[dict[str, Any]]) -> None:
    print("\nkvtier bench tiers: median TTFT ms [min-max] of", bench.args.runs, "runs")
    for row in sorted(bench.rows.values(), key=lambda r: (r.tokens, r.system, r.scenario)):
        d = row.as_dict()
        if "error" in d:
            continue
        print(
            f"  {row.tokens:>5} {row.system:>16} {row.scenario:>8} {d['ttft_ms']:9.1f} "
            f"[{d['min_ms']:.1f}-{d['max_ms']:.1f}]"
        )
    print("paired ratios: median [min-max]")
    for ratio in ratios:
        print(
            f"  {ratio['tokens']:>5} {ratio['ratio']:>34} {ratio['median']:6.3f} "
            f"[{ratio['min']:.3f}-{ratio['max']:.3f}]"
        )


def _run(args: argparse.Namespace) -> int:
    args.lengths = [int(x) for x in args.lengths.split(",")]
    bench = Bench(args)
    load_before = os.getloadavg()
    try:
        l2_systems = _kvtier(bench)
        bench.close()
        if not args.skip_peers:
            _peers(bench)
    finally:
        bench.close()
        if not args.l2_path:
            shutil.rmtree(bench.l2_dir, ignore_errors=True)  # GBs of blocks; logs are kept
    ratios = paired_ratios(bench.rows, l2_systems)
    breakdown = breakdown_rows(bench.breakdowns)
    meta = {
        "meta": "kvtier bench tiers",
        "runs": args.runs,
        "lengths": args.lengths,
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg())],
        "cpus": os.cpu_count(),
        "kvtier_a_save_cpu": bench.save_cpu,
    }
    rows = [meta] + [r.as_dict() for r in bench.rows.values()] + ratios + breakdown
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    _print_summary(bench, ratios)
    if bench.save_cpu:
        print(f"replica A's saves, off the engine's cores: {bench.save_cpu}")
    if breakdown:
        print("\nwhere a hit's time goes (median ms over runs; 'X L1': an L1 hit):")
        print(breakdown_table(breakdown))
    if args.chart and breakdown:
        write_chart(breakdown, Path(args.chart))
    print(f"kvtier bench tiers: {len(rows)} rows -> {args.json} (server logs: {bench.work})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "tiers",
        help="S1: TTFT cold / L0 / L1 / cross-replica L2, kvtier vs plain vLLM and peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--lengths",
        default="512,1024,2500,4000",
        help="prompt lengths in tokens, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=5,
        help="distinct prompts per length; rows report the median and min-max (default: 5)",
    )
    p.add_argument("--json", required=True, help="write the rows here")
    p.add_argument("--model", help="local HF model directory (default: the embedded model)")
    p.add_argument("--l2-path", help="shared L2 directory (default: a fresh temp directory)")
    p.add_argument(
        "--l1-gib",
        type=float,
        default=1.0,
        help="L1 budget of kvtier and of the offloading peers (default: 1)",
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
        "--queue-wait",
        choices=("vllm", "shared"),
        default="vllm",
        help="how every server's engine processes wait for each other's messages: vllm (a "
        "busy-wait of 1 s after each) or shared (sleep, recheck every 2 ms: what the local "
        "fleet uses) (default: %(default)s)",
    )
    p.add_argument(
        "--juicefs",
        action="store_true",
        help="also measure L2 hits through a JuiceFS volume in the same run (system "
        "'kvtier-juicefs': A's blocks land through one FUSE mount, the reader uses another)",
    )
    p.add_argument(
        "--valkey",
        action="store_true",
        help="also measure L2 hits from a loopback Valkey server in the same run (system "
        "'kvtier-valkey': A's blocks stored there as the Valkey tier stores them)",
    )
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        metavar="NAME:KEY=VALUE,...",
        help="one more L2-reading replica 'kvtier-NAME' with these connector settings, e.g. "
        "before:load_staging=false,background_cpus=inherit (repeatable)",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="read the connector metrics around every L1 hit and every L2 reader's hit and print "
        f"where the time goes ({', '.join(PHASES)})",
    )
    p.add_argument("--chart", help="with --breakdown: draw the breakdown as a PNG here")
    p.add_argument("--skip-peers", action="store_true", help="measure only kvtier and plain vLLM")
    p.set_defaults(func=_run)
