"""What a shared L2 needs around the tiers: servers and mounts, the capacity janitor, its CLI.

- `valkey_server`: start/stop a loopback Valkey (or Redis 7) server, for the Valkey L2 tier and
  as JuiceFS's metadata engine.
- `juicefs`: format a JuiceFS volume and mount it over FUSE (once per "node"), unmount reliably.
- `lease`: a lease in a shared directory (one janitor at a time across all replicas).
- `verify`: check every stored object's header and checksum.
- `cli`: `kvtier l2 status|gc|verify`.

The tiers themselves live in `kvtier.core.tiers` (`posix`, `valkey`), the janitor in
`kvtier.core.tiers.janitor`, per-file-system settings in `kvtier.core.tiers.profiles`.
"""
