"""Component configurations, validated on construction.

Each config is a frozen slotted dataclass with a docstring under every field; `__post_init__`
raises `ConfigError` naming the offending field. CLI flags derive from these fields. This module
imports only the standard library, `kvtier.core.errors`, and `kvtier.core.tiers.profiles` (plain data about
file systems, to check `l2_profile` by name).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.profiles import get_profile

L2_URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")
"""URL schemes of a Valkey/Redis L2 (`StoreConfig.l2_url`, `ValkeyTierConfig.url`)."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings of one replica's `TieredStore` (L1 host memory + optional shared L2).

        StoreConfig(l1_bytes=4 * 1024**3, l2_path="/mnt/shared/kvtier", admission="min-tokens",
                    admission_min_tokens=1024)
        StoreConfig(l2_path="/mnt/jfs/kvtier", l2_profile="juicefs",
                    l2_capacity_bytes=500 * 1024**3)          # + the capacity janitor
        StoreConfig(l2_url="redis://10.0.0.5:6379/0")         # L2 on Valkey/Redis

    L2 is at most one of `l2_path` and `l2_url`. Capacity (`l2_capacity_bytes`, watermarks,
    janitor interval) applies to `l2_path` only: a Valkey server bounds itself (`maxmemory`
    with an LRU policy).
    """

    l1_bytes: int = 2 * 1024**3
    """L1 host-memory budget in bytes (payload plus buffer overhead); 0 disables L1."""
    l2_path: str | None = None
    """Shared POSIX directory for L2 (a FUSE/NFS mount or a local dir); None: no directory L2."""
    admission: str = "always"
    """Name of the admission policy deciding which saved blocks are kept (see `kvtier.core.store`)."""
    admission_min_tokens: int = 0
    """For "min-tokens": admit a block only if its prefix (block index + 1) x tokens reaches this."""
    write_queue_blocks: int = 64
    """Capacity of the asynchronous L2 write queue in blocks; a full queue drops and counts."""
    io_threads: int = 2
    """Threads writing to L2 in the background (and checking existence in batched lookups)."""
    l2_exists_ttl_s: float = 1.0
    """How long an L2 existence answer is reused: by `lookup` (present or absent), and by
    `save`, which skips the write-through of a block confirmed in L2 this recently; 0 disables."""
    l2_url: str | None = None
    """Valkey/Redis server for L2 (`redis://host:port[/db]`); the store connects to it itself.
    None: no Valkey L2. Exclusive with `l2_path`."""
    l2_profile: str = "local"
    """File system under `l2_path` (`kvtier.core.tiers.profiles`: local, juicefs, curvine, nfs, efs):
    sets the janitor's tolerance for stale attributes and whether evictions go through a grace
    period (file systems where an unlink breaks other nodes' open readers)."""
    l2_capacity_bytes: int | None = None
    """Bytes the `l2_path` directory may hold, all replicas and models together. Set, this
    replica runs a capacity janitor; one holds a lease and acts at a time cluster-wide, so set the
    same value on every replica. None: no capacity enforcement from this replica."""
    l2_high_watermark: float = 0.9
    """Fraction of `l2_capacity_bytes` above which the janitor evicts."""
    l2_low_watermark: float = 0.75
    """Fraction of `l2_capacity_bytes` an eviction brings usage down to (and an idle L2 is
    trimmed to, so the next burst of writes starts with headroom)."""
    l2_janitor_interval_s: float = 5.0
    """Seconds between janitor passes (a pass scans the whole directory)."""
    l2_touch_interval_s: float = 60.0
    """A read hit in `l2_path` refreshes the block's mtime, the shared access record the janitor
    evicts by (least recently used first), when it is older than this: hot blocks cost one
    metadata write per interval. Recorded whether or not this replica runs the janitor."""

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
        self._check_l2()

    def _check_l2(self) -> None:
        if self.l2_url is not None:
            if not self.l2_url.startswith(L2_URL_SCHEMES):
                raise ConfigError(f"l2_url: expected redis://host:port[/db], got {self.l2_url!r}")
            if self.l2_path is not None:
                raise ConfigError("l2_url: set either l2_path or l2_url, not both")
            if self.l2_capacity_bytes is not None:
                raise ConfigError("l2_capacity_bytes: applies to l2_path only; a Valkey L2 is "
                                  "bounded by its server's maxmemory")
        get_profile(self.l2_profile)  # raises ConfigError naming l2_profile
        if self.l2_capacity_bytes is not None and self.l2_capacity_bytes <= 0:
            raise ConfigError(
                f"l2_capacity_bytes: must be positive or None, got {self.l2_capacity_bytes}")
        if not 0 < self.l2_low_watermark <= self.l2_high_watermark <= 1:
            raise ConfigError(f"l2_low_watermark/l2_high_watermark: need 0 < low <= high <= 1, "
                              f"got {self.l2_low_watermark}/{self.l2_high_watermark}")
        if self.l2_janitor_interval_s <= 0:
            raise ConfigError(
                f"l2_janitor_interval_s: must be positive, got {self.l2_janitor_interval_s}")
        if self.l2_touch_interval_s < 0:
            raise ConfigError(
                f"l2_touch_interval_s: must be >= 0, got {self.l2_touch_interval_s}")
