"""`LayeredCopy`: one step's loaded blocks copied into vLLM's KV cache layer by layer, beside
the forward pass that reads them.

vLLM calls `wait_for_layer_load(layer)` before each attention layer of a forward pass. A
synchronous load hands the copy of its L1 hits into the engine's blocks (L1's own buffers: no
read, and a view stays valid after eviction) to `LayeredCopy`, which runs on a background
thread: layer 0 of
every block, then layer 1, and so on, while the forward computes; `wait(layer)` returns once
that layer of every block is written. On CPU a forward pass spends longer on each layer than
the copy of that layer takes, so on a core the engine does not use the copy is done before the
forward needs it, and a hit costs the forward little more than the first layer's copy
(figures in docs/bench_tiers.md).

A copy that raises marks every layer done (no waiter hangs) and sets `failed`: the caller then
reports all its engine blocks as failed loads, which vLLM recomputes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvtier.vllm.transfer import PagedKV, PendingScatter

__all__ = ["LayeredCopy"]

log = logging.getLogger(__name__)


class LayeredCopy:
    def __init__(self, kv: PagedKV, pending: Sequence[PendingScatter]) -> None:
        self._kv = kv
        self._pending = pending
        self._layers = kv.layout.num_layers
        self._cond = threading.Condition()
        self._done = 0
        """Layers written in every block; `_layers + 1` once `run` returned."""
        self.failed = False
        self.copy_s = 0.0
        """Seconds `run` took (set when it returns)."""

    @property
    def engine_block_ids(self) -> list[int]:
        return [i for p in self._pending for i in p.engine_block_ids]

    def run(self) -> None:
        """Copy every block, layer by layer (on the copier thread)."""
        start = time.perf_counter()
        try:
            for layer in range(self._layers):
                for pending in self._pending:
                    self._kv.scatter_layer(layer, pending)
                with self._cond:
                    self._done = layer + 1
                    self._cond.notify_all()
        except Exception:
            log.exception("kvtier: the layered copy of a load failed")
            self.failed = True
        self.copy_s = time.perf_counter() - start
        with self._cond:
            self._done = self._layers + 1
            self._cond.notify_all()

    def wait(self, layer: int | None = None) -> float:
        """Block until `layer` is written in every block (None: until `run` returned); the
        seconds it waited."""
        target = self._layers + 1 if layer is None else layer + 1
        if self._done >= target:
            return 0.0
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._done >= target)
        return time.perf_counter() - start
