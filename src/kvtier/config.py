"""Component configurations, validated on construction.

Each config is a frozen slotted dataclass with a docstring under every field; `__post_init__`
raises `ConfigError` naming the offending field. CLI flags derive from these fields. This module
imports only the standard library and `kvtier.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of one replica's `TieredStore` (L1 host memory + optional shared L2).

        StoreConfig(l1_bytes=4 * 1024**3, l2_path="/mnt/shared/kvtier", admission="min-tokens",
                    admission_min_tokens=1024)
    """

    l1_bytes: int = 2 * 1024**3
    """L1 host-memory budget in bytes (payload plus buffer overhead); 0 disables L1."""
    l2_path: str | None = None
    """Shared POSIX directory for L2 (a FUSE/NFS mount or a local dir); None disables L2."""
    admission: str = "always"
    """Name of the admission policy deciding which saved blocks are kept (see `kvtier.store`)."""
    admission_min_tokens: int = 0
    """For "min-tokens": admit a block only if its prefix (block index + 1) x tokens reaches this."""
    write_queue_blocks: int = 64
    """Capacity of the asynchronous L2 write queue in blocks; a full queue drops and counts."""
    io_threads: int = 2
    """Threads writing to L2 in the background (and checking existence in batched lookups)."""
    l2_exists_ttl_s: float = 1.0
    """How long an L2 existence answer is reused: by `lookup` (present or absent), and by
    `save`, which skips the write-through of a block confirmed in L2 this recently; 0 disables."""

    def __post_init__(self) -> None:
        if self.l1_bytes < 0:
            raise ConfigError(f"l1_bytes: must be >= 0, got {self.l1_bytes}")
        if self.l2_path is not None and not self.l2_path:
            raise ConfigError("l2_path: must be None or a non-empty path")
        if not self.admission:
            raise ConfigError("admission: must name a policy")
        if self.admission_min_tokens < 0:
            raise ConfigError(
                f"admission_min_tokens: must be >= 0, got {self.admission_min_tokens}")
        if self.write_queue_blocks <= 0:
            raise ConfigError(
                f"write_queue_blocks: must be positive, got {self.write_queue_blocks}")
        if self.io_threads <= 0:
            raise ConfigError(f"io_threads: must be positive, got {self.io_threads}")
        if self.l2_exists_ttl_s < 0:
            raise ConfigError(f"l2_exists_ttl_s: must be >= 0, got {self.l2_exists_ttl_s}")
