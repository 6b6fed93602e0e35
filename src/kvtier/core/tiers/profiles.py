"""What differs between the file systems an L2 directory may live on, in one place.

The POSIX tier's code path is the same everywhere (unique temp file, `link()` publish, checksum
on read); a profile only sets the numbers and choices that depend on the file system:

- how stale another node's view can be (kernel attribute/dentry caches), which bounds how soon
  a block published elsewhere is seen and how long a lease heartbeat may look old;
- whether hard links and O_DIRECT work (and whether O_DIRECT needs alignment);
- whether a file unlinked on one node stays readable for a reader that has it open on another
  (if not, the janitor evicts through a graveyard with a grace period);
- the object size the file system handles well.

Sources: measurements on JuiceFS 1.4.2 (two FUSE mounts of one volume) and a local ext4
directory on this project's machines, Curvine's code and docs, NFS/EFS documentation (see
`/shared/reference/l2_backends.md` §1.2, §2.2). Look one up with `get_profile(name)`; the
janitor derives its staleness, lease and grace settings from it (`JanitorSettings.for_profile`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.core.errors import ConfigError
from kvtier.core.settings import L2ProfileName

MIB = 1024**2
LOCAL_FILE_SYSTEMS = frozenset(
    {"btrfs", "ext2", "ext3", "ext4", "f2fs", "overlay", "tmpfs", "xfs", "zfs"}
)
"""File systems on a local disk (or in memory): a read of a cached block cannot stall."""


@dataclass(frozen=True, slots=True)
class L2Profile:
    """Properties of one file system as an L2 directory (see the module docstring)."""

    name: L2ProfileName
    attr_cache_s: float
    """How long another node may see old attributes or dentries (a replaced or removed file)."""
    negative_cache_s: float
    """How long another node may keep answering "absent" for a newly published block."""
    hard_links: bool
    """`link()` works, so publish-if-absent is atomic (else rename-into-place is used)."""
    o_direct: bool
    """O_DIRECT opens work at all."""
    o_direct_aligned: bool
    """O_DIRECT needs buffer/offset/length aligned to the block size (EINVAL otherwise)."""
    direct_reads: bool
    """L2 reads open block files with O_DIRECT by default: through a FUSE client that needs no
    alignment this skips the kernel page cache and its copy (docs/bench_tiers.md); what was read
    stays in kvtier's L1 instead."""
    piece_reads: frozenset[str]
    """The file systems (types as /proc/mounts names them) on which a block may be read in
    pieces beside the forward pass that needs it (the connector's layered copy): where a
    piece's read is short and was measured to keep ahead of the forward (a stalled one holds
    the forward until the load deadline, then the blocks are recomputed)."""
    unlink_safe_across_nodes: bool
    """A reader on another node that has the file open keeps reading after an unlink."""
    cluster_wide_flock: bool
    """flock/fcntl locks exclude across nodes (kvtier does not rely on it; informative)."""
    recommended_object_bytes: int
    """Block size (tokens x KV bytes per token) to aim for; much smaller objects are dominated
    by per-file metadata operations."""
    eviction: str
    """What the file system itself can evict, and what to configure."""
    mount_hints: tuple[str, ...]
    """Mount/format options that matter for a KV L2."""


PROFILES: dict[L2ProfileName, L2Profile] = {
    p.name: p
    for p in (
        L2Profile(
            name="local",
            attr_cache_s=0.0,
            negative_cache_s=0.0,
            hard_links=True,
            o_direct=True,
            o_direct_aligned=True,
            direct_reads=False,
            piece_reads=LOCAL_FILE_SYSTEMS,
            unlink_safe_across_nodes=True,
            cluster_wide_flock=True,
            recommended_object_bytes=1 * MIB,
            eviction="none: the kvtier janitor enforces capacity",
            mount_hints=(
                "a local disk is node-private: share it only between replicas of one node",
            ),
        ),
        L2Profile(
            name="juicefs",
            attr_cache_s=1.0,
            negative_cache_s=0.0,
            hard_links=True,
            o_direct=True,
            o_direct_aligned=False,
            direct_reads=True,
            piece_reads=frozenset({"fuse.juicefs"}),
            unlink_safe_across_nodes=False,
            cluster_wide_flock=True,
            recommended_object_bytes=4 * MIB,
            eviction="none for the namespace (quotas only give EDQUOT): run the kvtier janitor",
            mount_hints=(
                "juicefs format --trash-days 0 (else deletes free nothing for a day)",
                "metadata in Redis/Valkey or TiKV for many nodes; SQLite for one",
                "--attr-cache 1 --entry-cache 1 --dir-entry-cache 1 (the defaults)",
                "--cache-dir on local NVMe; objects >= the 4 MiB JuiceFS block",
                (
                    "--max-fuse-io 1M (Linux 4.20+): whole blocks read and written in 1 MiB "
                    "FUSE requests, not 128 KiB ones (docs/l2.md: the gain)"
                ),
                (
                    "--max-readahead 0: a hit read layer by layer asks for every block's "
                    "first layer at once, and read-ahead made each of those wait "
                    "(docs/l2.md: the cost)"
                ),
                (
                    "--cache-size 0 where the object store is as close as the cache disk: "
                    "else a reading node writes every block it fetches into its cache "
                    "(docs/l2.md: the cost); kvtier's L1 keeps what a replica read"
                ),
            ),
        ),
        L2Profile(
            name="curvine",
            attr_cache_s=1.0,
            negative_cache_s=0.0,
            hard_links=True,
            o_direct=True,
            o_direct_aligned=False,
            direct_reads=True,
            piece_reads=frozenset(),
            unlink_safe_across_nodes=False,
            cluster_wide_flock=True,
            recommended_object_bytes=4 * MIB,
            eviction=(
                "TTL (ttl_action=delete, short ttl_ms, ttl_checker_interval ~5m) plus "
                "enable_quota_eviction; quota eviction only deletes TTL-expired files, so "
                "keep the kvtier janitor as the capacity bound"
            ),
            mount_hints=(
                "entry_timeout_ms/attr_timeout_ms <= 1000, negative_timeout_ms = 0",
                "enable_meta_cache = false; direct_io = false",
                "worker_policy = local, short_circuit = true",
            ),
        ),
        L2Profile(
            name="nfs",
            attr_cache_s=3.0,
            negative_cache_s=30.0,
            hard_links=True,
            o_direct=True,
            o_direct_aligned=False,
            direct_reads=False,
            piece_reads=frozenset(),
            unlink_safe_across_nodes=False,
            cluster_wide_flock=True,
            recommended_object_bytes=4 * MIB,
            eviction="none: run the kvtier janitor",
            mount_hints=(
                (
                    "lookupcache=positive (else a block published elsewhere can look "
                    "absent for acdirmin, 30 s)"
                ),
                "actimeo=1 for fresher attributes",
                "rsize=wsize=1048576",
            ),
        ),
        L2Profile(
            name="efs",
            attr_cache_s=3.0,
            negative_cache_s=30.0,
            hard_links=True,
            o_direct=True,
            o_direct_aligned=False,
            direct_reads=False,
            piece_reads=frozenset(),
            unlink_safe_across_nodes=False,
            cluster_wide_flock=True,
            recommended_object_bytes=8 * MIB,
            eviction="none: run the kvtier janitor (EFS bills stored bytes)",
            mount_hints=(
                "amazon-efs-utils (NFSv4.1, TLS); lookupcache=positive",
                "per-operation latency is milliseconds: large objects, parallel reads",
            ),
        ),
    )
}


def get_profile(name: str) -> L2Profile:
    """The profile named `name` (one of `L2ProfileName`)."""
    if name not in PROFILES:
        raise ConfigError(f"l2_profile: one of {sorted(PROFILES)}, got {name!r}")
    return PROFILES[name]
