"""Moving kvtier blocks between vLLM's paged KV tensors and contiguous host payloads.

A kvtier block of `block_tokens` tokens is `per_block` consecutive engine blocks. Its payload
keeps each engine block's bytes verbatim, layer by layer:

    payload[layer, j] = kv_cache[layer][engine_block_ids[j]]      shape (layers, per_block, *engine)

so no layout is interpreted or converted, and a block written by one replica is byte-for-byte
what another replica with the same namespace (same backend, geometry, dtype) reads.

Called only from the worker side's background threads (`worker_side`): `gather` by the saver,
`scatter` by the loader. On CPU `gather` is `index_select` per layer, and `scatter` copies
block by block through numpy byte views of the tensors; `scatter_layer` copies one layer of a
`PendingScatter` (the layered copy beside the forward pass, `kvtier.vllm.layered_copy`). On
CUDA, `gather` selects the blocks into a device staging buffer and copies it to a pinned host
buffer, and `scatter` copies the payload through pinned and device staging and then into the
blocks, each on a side stream, synchronising only that stream: the forward pass is never
blocked. vLLM queues its forward pass on a stream of its own, not the default one, so the
worker takes a `forward_mark` on its thread and the copy's side stream waits for that mark.
(CI has no GPU: the CUDA path runs in `tests/gpu` on a GPU machine.)
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.core.codec import BlockMeta
from kvtier.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Shape of one kvtier block's payload."""

    num_layers: int
    per_block: int
    """Engine blocks per kvtier block."""
    engine_block_shape: tuple[int, ...]
    """Shape of one engine block in one layer's KV tensor (e.g. heads, 128, 2 x head_size)."""
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.per_block, *self.engine_block_shape)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def matches(self, meta: BlockMeta) -> bool:
        """Whether a block of `meta` has this layout."""
        return meta.shape == self.shape and meta.dtype == self.dtype_name

    @property
    def payload_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def _layer_order(name: str) -> tuple[object, ...]:
    """Natural sort key: "layers.10" after "layers.9"."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


class PagedKV:
    """The registered per-layer KV tensors of one worker (one TP rank)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], per_block: int) -> None:
        if not kv_caches:
            raise ConfigError("kv_caches: vLLM registered no KV cache tensors")
        names = sorted(kv_caches, key=_layer_order)
        self.layers = [kv_caches[n] for n in names]
        self.layer_index = {name: i for i, name in enumerate(names)}
        """Layer position by vLLM's layer name (the forward pass runs them in this order)."""
        first = self.layers[0]
        for name, t in zip(names, self.layers, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError(
                    f"kv_caches: layer {name} has shape {tuple(t.shape)} "
                    f"{t.dtype}, unlike {tuple(first.shape)} {first.dtype}"
                )
        self.device = first.device
        self.layout = BlockLayout(
            num_layers=len(self.layers),
            per_block=per_block,
            engine_block_shape=tuple(first.shape[1:]),
            dtype=first.dtype,
        )
        self._cuda = _CudaStaging(self.layout, self.device) if self.device.type == "cuda" else None
        self._host = [_bytes_array(t) for t in self.layers] if self._cuda is None else []
        """The layers as numpy byte arrays: a block copied by slice assignment costs a
        fraction of torch's per-call dispatch of `index_copy_` (docs/bench_tiers.md)."""

    @property
    def num_engine_blocks(self) -> int:
        return int(self.layers[0].shape[0])

    def new_host_buffer(self) -> torch.Tensor:
        """A host tensor shaped like one payload (pinned when the cache is on CUDA)."""
        return torch.empty(
            self.layout.shape, dtype=self.layout.dtype, pin_memory=self._cuda is not None
        )

    def forward_mark(self) -> Any:
        """A mark after the work the calling thread has queued so far (on CUDA, an event on
        its current stream, where vLLM queues the forward pass; None on CPU, where work is done
        once queued). A `gather` or `scatter` given it runs after that work."""
        if self._cuda is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def gather(self, engine_block_ids: Sequence[int], out: torch.Tensor, after: Any = None) -> None:
        """Copy the engine blocks of one kvtier block into `out` (a host buffer), after the
        work `after` (a `forward_mark`; None: the calling thread's queued work) marks."""
        self._check_ids(engine_block_ids, self.layout.per_block)
        if self._cuda is not None:
            self._cuda.gather(self.layers, engine_block_ids, out, after)
            return
        idx = torch.tensor(engine_block_ids, dtype=torch.long)
        for layer, t in enumerate(self.layers):
            torch.index_select(t, 0, idx, out=out[layer])

    def scatter(
        self, src: torch.Tensor, engine_block_ids: Sequence[int], skip: int = 0, after: Any = None
    ) -> None:
        """Write engine blocks `skip`, `skip + 1`, ... of a payload into `engine_block_ids`,
        after the work `after` marks (as `gather`: the blocks' earlier owner may still read them).

        The first `skip` engine blocks of the kvtier block are left alone (they already hold
        locally computed KV); fewer ids than the rest of the block write only a leading part.
        """
        self.check_scatter(engine_block_ids, skip)
        if not engine_block_ids:
            return
        end = skip + len(engine_block_ids)
        if self._cuda is not None:
            self._cuda.scatter(self.layers, src[:, skip:end], engine_block_ids, after)
            return
        payload = _bytes_array(src)
        for j, block in enumerate(engine_block_ids, start=skip):
            for layer, cache in enumerate(self._host):
                cache[block] = payload[layer, j]

    def pending_scatter(
        self, src: torch.Tensor, engine_block_ids: Sequence[int], skip: int = 0
    ) -> PendingScatter:
        """A `scatter` to run later, one layer at a time (`scatter_layer`); CPU only."""
        if self._cuda is not None:
            raise ValueError("a layered scatter runs on CPU caches only")
        self.check_scatter(engine_block_ids, skip)
        return PendingScatter(_bytes_array(src), tuple(engine_block_ids), skip)

    def scatter_layer(self, layer: int, pending: PendingScatter) -> None:
        """Write `layer` of a pending scatter's blocks."""
        self.scatter_piece(layer, pending.payload[layer], pending.engine_block_ids, pending.skip)

    def scatter_piece(
        self, layer: int, piece: Any, engine_block_ids: Sequence[int], skip: int = 0
    ) -> None:
        """Write one layer of a payload (`piece`: numpy bytes indexed by engine block, as
        `piece_buffer` makes) into engine blocks `skip`.. (ids `pending_scatter` accepted)."""
        cache = self._host[layer]
        for j, block in enumerate(engine_block_ids, start=skip):
            cache[block] = piece[j]

    def piece_buffer(self) -> Any:
        """A host buffer for one layer of one payload (numpy bytes indexed by engine block)."""
        return _bytes_array(torch.empty(self.layout.shape[1:], dtype=self.layout.dtype))

    @property
    def piece_bytes(self) -> int:
        """Bytes of one layer of one payload."""
        return self.layout.payload_bytes // self.layout.num_layers

    def check_scatter(self, engine_block_ids: Sequence[int], skip: int) -> None:
        """Raise ValueError unless `scatter` takes these ids with this skip."""
        if len(engine_block_ids) > self.layout.per_block - skip:
            raise ValueError(
                f"at most {self.layout.per_block - skip} engine block ids, got "
                f"{len(engine_block_ids)}"
            )
        self._check_ids(engine_block_ids, len(engine_block_ids))

    def _check_ids(self, ids: Sequence[int], expected: int) -> None:
        if len(ids) != expected:
            raise ValueError(f"expected {expected} engine block ids, got {len(ids)}")
        n = self.num_engine_blocks
        if any(not 0 <= i < n for i in ids):
            raise ValueError(f"engine block id outside 0..{n - 1}: {list(ids)}")


@dataclass(frozen=True, slots=True)
class PendingScatter:
    """A payload's engine blocks `skip`, `skip + 1`, ... bound for `engine_block_ids`."""

    payload: Any
    """The payload's bytes (a numpy uint8 array, indexed [layer, engine block])."""
    engine_block_ids: tuple[int, ...]
    skip: int


def _bytes_array(t: torch.Tensor) -> Any:
    """A numpy uint8 array over a host tensor's memory (its strides kept; numpy has no
    bfloat16, bytes copy the same)."""
    return t.view(torch.uint8).numpy()


def payload_view(payload: memoryview, layout: BlockLayout) -> torch.Tensor:
    """A tensor over a stored payload's bytes (zero-copy; the caller only reads it)."""
    if payload.nbytes != layout.payload_bytes:
        raise ValueError(f"payload has {payload.nbytes} bytes, layout needs {layout.payload_bytes}")
    with warnings.catch_warnings():  # read-only buffers warn; the view is never written
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(payload, dtype=torch.uint8)
    return raw.view(layout.dtype).view(layout.shape)


def host_bytes(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, as the store's `save` takes them."""
    return memoryview(_bytes_array(buffer)).cast("B")


class _CudaStaging:
    """One payload's pinned and device staging and a side stream (CUDA only): a block crosses
    between host and device in one contiguous copy, and the per-layer work (`index_select`,
    `index_copy_`) stays on the device, where a launch per layer costs microseconds."""

    def __init__(self, layout: BlockLayout, device: torch.device) -> None:
        self.layout = layout
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.pinned = torch.empty(layout.shape, dtype=layout.dtype, pin_memory=True)
        self.on_device = torch.empty(layout.shape, dtype=layout.dtype, device=device)
        self._lock = threading.Lock()  # one stream and one staging: one copy at a time

    def gather(
        self, layers: Sequence[torch.Tensor], ids: Sequence[int], out: torch.Tensor, after: Any
    ) -> None:
        device = layers[0].device
        with self._lock, torch.cuda.stream(self.stream):
            self._wait(after, device)  # the forward pass writes these blocks
            idx = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
            for layer, t in enumerate(layers):
                torch.index_select(t, 0, idx, out=self.on_device[layer])
            out.copy_(self.on_device, non_blocking=True)
            self.stream.synchronize()

    def scatter(
        self, layers: Sequence[torch.Tensor], src: torch.Tensor, ids: Sequence[int], after: Any
    ) -> None:
        """`src`: (layers, len(ids), *engine block) in host memory, pinned or not."""
        device = layers[0].device
        n = len(ids)
        with self._lock, torch.cuda.stream(self.stream):
            # the blocks may have held another request's KV, which queued work can still read
            self._wait(after, device)
            staged = self.on_device[:, :n]
            if src.is_pinned():  # an L2 read into the loader's staging: straight over the bus
                staged.copy_(src, non_blocking=True)
            else:  # a copy from ordinary memory straight to the device is slower than two
                pinned = self.pinned[:, :n]
                pinned.copy_(src)
                staged.copy_(pinned, non_blocking=True)
            idx = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
            for layer, t in enumerate(layers):
                t.index_copy_(0, idx, staged[layer])
            self.stream.synchronize()

    def _wait(self, after: Any, device: torch.device) -> None:
        """Order the side stream after the work `after` marks; None: after the default stream
        (the calling thread's queued work, for a thread that never set a stream)."""
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.default_stream(device))
