"""`kvtier bench transfer`: the connector's copies between vLLM's paged KV cache and host memory.

    kvtier bench transfer --json out/transfer.json                 # CUDA when present, else CPU
    kvtier bench transfer --device cpu --layers 30 --kv-heads 3 --head-size 64 --engine-block 128

What a save and a hit move besides the store. `gather` (the saver) copies the engine blocks of
one kvtier block out of the per-layer KV tensors into a host buffer (pinned on CUDA).
`scatter` (the loader) copies a payload into other engine blocks: from ordinary memory, as L1
holds blocks, and, as `scatter_pinned`, from pinned memory, where the loader reads L2 hits on
CUDA. Each pass moves `--blocks` kvtier blocks at random engine block ids and is timed to the
end of its copies. Beside them, in the same pass, the same bytes in contiguous copies: between
the device and pinned host memory (`link_*`: the bus's speed, the ceiling), and from ordinary
host memory to the device (`pageable_h2d`: a naive copy). Every pass is checked: the gathered
bytes equal the engine blocks, and the scattered blocks equal the payloads. (On CPU every
"copy" is a memcpy.)

The KV tensors have vLLM 0.32's layout (FlashAttention, Triton and CPU backends alike):
(engine blocks, KV heads, block tokens, 2 x head size) per layer. The defaults are a Llama-3-8B
shaped cache (32 layers, 8 KV heads of 128, bf16, 16-token engine blocks, 256-token kvtier
blocks: 32 MiB per block).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.core.errors import ConfigError

__all__ = ["FIGURES", "TransferGeometry", "measure", "register"]

FIGURES = ("gather", "scatter", "scatter_pinned", "link_d2h", "link_h2d", "pageable_h2d")
"""GB/s figures of a row: the connector's copies, then the floors beside them."""


@dataclass(frozen=True, slots=True)
class TransferGeometry:
    """One TP rank's paged KV cache and the kvtier block size."""

    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    engine_block: int = 16
    """Tokens per engine block (vLLM's block size)."""
    block_tokens: int = 256
    """Tokens per kvtier block."""
    engine_blocks: int = 2048
    """Engine blocks per layer tensor."""
    dtype: str = "bfloat16"

    @property
    def per_block(self) -> int:
        return self.block_tokens // self.engine_block


def measure(
    geometry: TransferGeometry, device: str, blocks: int, repeats: int, seed: int = 0
) -> dict[str, Any]:
    """Median and spread (GB/s) of gather, scatter and the floors beside them over `repeats`
    passes of `blocks` kvtier blocks; AssertionError if any pass moved wrong bytes,
    ConfigError for a geometry that cannot be measured."""
    import torch

    from kvtier.vllm.transfer import PagedKV, host_bytes, payload_view

    if geometry.block_tokens % geometry.engine_block:
        raise ConfigError(
            f"--block-tokens {geometry.block_tokens}: not a multiple of --engine-block "
            f"{geometry.engine_block}"
        )
    if blocks * geometry.per_block * 3 > geometry.engine_blocks:
        raise ConfigError(
            f"{blocks} kvtier blocks need {blocks * geometry.per_block * 3} engine blocks "
            f"(gathered and twice scattered ones apart); raise --engine-blocks"
        )
    dtype = getattr(torch, geometry.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (
        geometry.engine_blocks,
        geometry.kv_heads,
        geometry.engine_block,
        2 * geometry.head_size,
    )
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            shape, generator=gen, device=device, dtype=torch.float32
        ).to(dtype)
        for i in range(geometry.layers)
    }
    kv = PagedKV(caches, geometry.per_block)
    cuda = kv.device.type == "cuda"
    nbytes = kv.layout.payload_bytes
    rng = torch.Generator().manual_seed(seed)
    gathered = [kv.new_host_buffer() for _ in range(blocks)]  # pinned on CUDA, as the saver's
    payloads = [torch.empty(kv.layout.shape, dtype=dtype) for _ in range(blocks)]  # as L1's
    flat_device = torch.empty(nbytes * blocks, dtype=torch.uint8, device=device)
    flat_pinned = torch.empty(nbytes * blocks, dtype=torch.uint8, pin_memory=cuda)
    # written: pages never touched read as the shared zero page, faster than any real memory
    flat_host = torch.randint(0, 256, (nbytes * blocks,), dtype=torch.uint8, generator=rng)

    def timed(run: Callable[[], None]) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        return nbytes * blocks / (time.perf_counter() - start) / 1e9

    def contiguous(dst: Any, src: Any) -> Callable[[], None]:
        def run() -> None:
            for i in range(blocks):
                dst[i * nbytes : (i + 1) * nbytes].copy_(src[i * nbytes : (i + 1) * nbytes])

        return run

    def gather_all(sources: list[list[int]]) -> None:
        for ids, out in zip(sources, gathered, strict=True):
            kv.gather(ids, out)

    def scatter_all(targets: list[list[int]], payloads: list[Any]) -> None:
        for ids, payload in zip(targets, payloads, strict=True):
            view = payload_view(memoryview(host_bytes(payload)).toreadonly(), kv.layout)
            kv.scatter(view, ids)

    figures: dict[str, list[float]] = {name: [] for name in FIGURES}
    per = geometry.per_block
    for repeat in range(repeats + 1):  # the first pass warms allocators and pages
        order = torch.randperm(geometry.engine_blocks, generator=rng).tolist()
        sources = [order[i * per : (i + 1) * per] for i in range(blocks)]
        # loads from L1 (ordinary memory) and from L2 (read into the loader's pinned staging)
        targets, from_pinned = (
            [order[(k * blocks + i) * per : (k * blocks + i + 1) * per] for i in range(blocks)]
            for k in (1, 2)
        )

        samples = {"gather": timed(functools.partial(gather_all, sources))}
        for out, payload in zip(gathered, payloads, strict=True):
            payload.copy_(out)  # into L1 (the store's copy, measured by `kvtier bench store`)
        samples["scatter"] = timed(functools.partial(scatter_all, targets, payloads))
        samples["scatter_pinned"] = timed(functools.partial(scatter_all, from_pinned, gathered))
        samples["link_d2h"] = timed(contiguous(flat_pinned, flat_device))
        samples["link_h2d"] = timed(contiguous(flat_device, flat_pinned))
        samples["pageable_h2d"] = timed(contiguous(flat_device, flat_host))
        _check(kv, sources, payloads, targets, from_pinned)
        if repeat > 0:
            for name, value in samples.items():
                figures[name].append(value)
    row: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "geometry": asdict(geometry),
        "block_bytes": nbytes,
        "blocks_per_pass": blocks,
        "repeats": repeats,
        "verified": True,
    }
    for name, values in figures.items():
        row[f"{name}_gbps"] = round(statistics.median(values), 3)
        row[f"{name}_gbps_range"] = [round(min(values), 3), round(max(values), 3)]
    row["gather_vs_link"] = round(row["gather_gbps"] / row["link_d2h_gbps"], 3)
    row["scatter_vs_link"] = round(row["scatter_gbps"] / row["link_h2d_gbps"], 3)
    row["scatter_pinned_vs_link"] = round(row["scatter_pinned_gbps"] / row["link_h2d_gbps"], 3)
    row["scatter_vs_pageable"] = round(row["scatter_gbps"] / row["pageable_h2d_gbps"], 3)
    return row


def _check(
    kv: Any, sources: list[list[int]], payloads: list[Any], *target_sets: list[list[int]]
) -> None:
    """Every payload holds its source blocks, and every block of each set of targets now
    holds them too."""
    import torch

    for k, (src, payload) in enumerate(zip(sources, payloads, strict=True)):
        for layer, t in enumerate(kv.layers):
            expected = t[torch.tensor(src, device=t.device)]
            assert torch.equal(payload[layer].to(t.device), expected), "gather moved wrong bytes"
            for targets in target_sets:
                got = t[torch.tensor(targets[k], device=t.device)]
                assert torch.equal(got, expected), "scatter moved wrong bytes"


def _cmd(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA GPU here")
    geometry = TransferGeometry(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        engine_block=args.engine_block,
        block_tokens=args.block_tokens,
        engine_blocks=args.engine_blocks,
        dtype=args.dtype,
    )
    row = measure(geometry, device, args.blocks, args.repeats)
    print(json.dumps(row, indent=2), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([row], indent=2) + "\n")
    return 0


def _parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = TransferGeometry()
    parser.add_argument("--json", metavar="FILE", help="write the row here")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), help="default: cuda when torch sees a GPU"
    )
    parser.add_argument("--layers", type=int, default=g.layers, help="layers of the model")
    parser.add_argument("--kv-heads", type=int, default=g.kv_heads, help="per TP rank")
    parser.add_argument(
        "--head-size", type=int, default=g.head_size, help="values per attention head"
    )
    parser.add_argument(
        "--engine-block", type=int, default=g.engine_block, help="vLLM's block size (tokens)"
    )
    parser.add_argument(
        "--block-tokens", type=int, default=g.block_tokens, help="kvtier's block size (tokens)"
    )
    parser.add_argument(
        "--engine-blocks", type=int, default=g.engine_blocks, help="engine blocks per layer"
    )
    parser.add_argument(
        "--dtype",
        default=g.dtype,
        choices=("bfloat16", "float16", "float32", "float8_e4m3fn"),
        help="dtype of the KV cache",
    )
    parser.add_argument("--blocks", type=int, default=16, help="kvtier blocks per pass")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes (median, range)")
    parser.set_defaults(func=_cmd)
    return parser


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _parser(
        subparsers.add_parser(
            "transfer",
            help="GB/s of the connector's copies between vLLM's KV cache and host memory",
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


if __name__ == "__main__":  # runs where the `kvtier` command's other dependencies are absent
    cli = _parser(argparse.ArgumentParser(prog="python -m kvtier.tools.bench.transfer"))
    parsed = cli.parse_args()
    raise SystemExit(parsed.func(parsed))
