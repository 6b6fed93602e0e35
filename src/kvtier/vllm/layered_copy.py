"""`LayeredCopy`: one step's loaded blocks copied into vLLM's KV cache layer by layer, beside
the forward pass that reads them.

vLLM calls `wait_for_layer_load(layer)` before each attention layer of a forward pass. A
synchronous load hands its blocks to `LayeredCopy` instead of copying them: L1 hits as L1's own
buffers (a view stays valid after eviction), L2 hits (where the L2 profile reads pieces) as
opened files (`PendingRead`). On a background thread it writes layer 0 of every block (an L2
block's layer is read into a small buffer, hashed, then copied; its header comes with layer 0
and is validated before anything is copied), then layer 1, and so on, while the forward
computes; `wait(layer)` returns once that layer of every block is written. On CPU a forward
pass spends longer on each layer than that takes, so on a core the engine does not use the
copy stays ahead of the forward, and a hit costs the forward little more than its first layer
(figures in docs/bench_tiers.md).

`failed` lists the engine blocks to report as failed loads, which vLLM recomputes (dropping the
step's output for the request): an L2 block whose read fails, whose header is invalid or of
another layout, or whose checksum, known once every layer is read, does not match; every block
when the copy raises; and, once `settle()` was called (a wait past the load deadline: a read
may be stalled), every block not complete. After `settle()` nothing more is written into the
engine's cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.core.errors import CodecError
from kvtier.core.tiers.posix import OpenedBlock
from kvtier.vllm.transfer import PagedKV, PendingScatter

__all__ = ["LayeredCopy", "PendingRead"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingRead:
    """An L2 block to read layer by layer into engine blocks `skip`.. (`engine_block_ids`)."""

    block: OpenedBlock
    engine_block_ids: tuple[int, ...]
    skip: int


Pending = PendingScatter | PendingRead


class _Settled(Exception):
    pass


class LayeredCopy:
    def __init__(self, kv: PagedKV, pending: Sequence[Pending]) -> None:
        self._kv = kv
        self._pending = pending
        self._layers = kv.layout.num_layers
        self._cond = threading.Condition()
        self._writing = threading.Lock()
        """Held while writing into the engine's cache, and by `settle`."""
        self._done = 0
        """Layers written in every block; `_layers + 1` once `run` returned."""
        self._settled = False
        self._complete: list[bool | None] = [None] * len(pending)
        """Per block: True written (and verified), False failed, None not yet known."""
        self.copy_s = 0.0
        """Seconds `run` took (set when it returns)."""

    @property
    def engine_block_ids(self) -> list[int]:
        return [i for p in self._pending for i in p.engine_block_ids]

    @property
    def failed(self) -> list[int]:
        """Engine block ids not (yet) complete: final once `wait()` returned True, or after
        `settle()`."""
        with self._cond:
            return [
                i
                for pending, ok in zip(self._pending, self._complete, strict=True)
                if not ok
                for i in pending.engine_block_ids
            ]

    def run(self) -> None:
        """Copy every block, layer by layer, then verify the reads (on the copier thread)."""
        start = time.perf_counter()
        reads = any(isinstance(p, PendingRead) for p in self._pending)
        piece = self._kv.piece_buffer() if reads else None
        try:
            for layer in range(self._layers):
                for k, pending in enumerate(self._pending):
                    if self._complete[k] is None:
                        self._copy(layer, k, pending, piece)
                with self._cond:
                    self._done = layer + 1
                    self._cond.notify_all()
            for k, pending in enumerate(self._pending):
                if self._complete[k] is None:
                    ok = not isinstance(pending, PendingRead) or pending.block.finish()
                    with self._cond:
                        self._complete[k] = ok
        except _Settled:
            pass
        except Exception:
            log.exception("kvtier: the layered copy of a load failed")
        finally:
            for k, pending in enumerate(self._pending):
                if isinstance(pending, PendingRead) and self._complete[k] is None:
                    pending.block.abandon()
            self.copy_s = time.perf_counter() - start
            with self._cond:
                self._done = self._layers + 1
                self._cond.notify_all()

    def _copy(self, layer: int, k: int, pending: Pending, piece: Any) -> None:
        if isinstance(pending, PendingRead) and not self._read(layer, k, pending.block, piece):
            return
        with self._writing:
            if self._settled:
                raise _Settled
            if isinstance(pending, PendingRead):
                self._kv.scatter_piece(layer, piece, pending.engine_block_ids, pending.skip)
            else:
                self._kv.scatter_layer(layer, pending)

    def _read(self, layer: int, k: int, block: OpenedBlock, piece: Any) -> bool:
        """Read `layer` of block `k` into `piece`; False: the block failed (its file closed)."""
        try:
            block.read_at(layer * self._kv.piece_bytes, memoryview(piece).cast("B"))
            if layer == 0 and (block.meta is None or not self._kv.layout.matches(block.meta)):
                raise CodecError(f"layout: {block.meta}, expected {self._kv.layout}")  # (header)
        except (OSError, CodecError) as exc:
            log.warning(
                "kvtier: L2 block %s: read failed (%s); vLLM recomputes it",
                block.block_hash.hex(),
                exc,
            )
            block.abandon()
            with self._cond:
                self._complete[k] = False
            return False
        return True

    @property
    def settled(self) -> bool:
        return self._settled

    def settle(self) -> None:
        """Stop writing into the engine's cache (a write under way finishes first)."""
        with self._writing:
            self._settled = True

    def wait(self, layer: int | None = None, until: float | None = None) -> bool:
        """Block until `layer` is written in every block (None: until `run` returned), or
        until the monotonic time `until`; whether it got there."""
        target = self._layers + 1 if layer is None else layer + 1
        if self._done >= target:
            return True
        with self._cond:
            timeout = None if until is None else max(0.0, until - time.monotonic())
            return self._cond.wait_for(lambda: self._done >= target, timeout)
