"""The shared L2 a `StoreSettings` names, built together with what keeps it within bounds.

    l2_path  `PosixTier` on the directory, reporting read hits to an `AccessRecorder` (the
             shared recency record), and, with `l2_capacity_bytes`, a started `Janitor` that
             enforces the directory's capacity under its cluster-wide lease.
    l2_url   `ValkeyTier` on the server (which bounds itself with `maxmemory`).

`open_shared_l2` is called once, by `TieredStore.__init__`; the `SharedL2` it returns belongs to
that store, which closes it (janitor thread first, then the tier) in `close()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.core.keys import ModelIdentity
from kvtier.core.settings import StoreSettings
from kvtier.core.tiers.base import BlockTier
from kvtier.core.tiers.janitor import AccessRecorder, Janitor, JanitorSettings
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.profiles import get_profile

log = logging.getLogger(__name__)

__all__ = ["SharedL2", "janitor_settings", "open_shared_l2"]


@dataclass(frozen=True, slots=True)
class SharedL2:
    """An opened L2 tier and the janitor this replica runs for it (if any)."""

    tier: BlockTier
    janitor: Janitor | None = None
    access: AccessRecorder | None = None
    """Read hits recorded for the janitor (directory L2 only)."""

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the janitor (handing its lease over at once; a pass stuck in a hung mount is
        waited for up to `timeout_s`), then release the tier."""
        if self.janitor is not None:
            self.janitor.close(timeout_s)
        self.tier.close()


def janitor_settings(config: StoreSettings) -> JanitorSettings | None:
    """The janitor settings `config` asks for: its profile's, with its capacity and timing."""
    if config.l2_path is None or config.l2_capacity_bytes is None:
        return None
    return JanitorSettings.for_profile(
        get_profile(config.l2_profile),
        config.l2_capacity_bytes,
        high_watermark=config.l2_high_watermark,
        low_watermark=config.l2_low_watermark,
        interval_s=config.l2_janitor_interval_s,
    )


def open_shared_l2(
    config: StoreSettings, identity: ModelIdentity, *, clock: Callable[[], float] = time.monotonic
) -> SharedL2 | None:
    """The L2 of `config`, or None when it names none.

    Raises `TierError` when the L2 directory is unusable (missing, not writable); a Valkey
    server that is down is not an error here: the tier answers misses until it is back. A
    janitor that cannot start (its control directory is not writable) is logged and skipped:
    the store still works, only this replica does not enforce the capacity.
    """
    namespace, manifest = identity.namespace(), identity.manifest()
    if config.l2_url is not None:
        from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings  # ~0.1 s of imports

        valkey_settings = ValkeyTierSettings(
            url=config.l2_url,
            username=config.l2_username,
            password_file=config.l2_password_file,
            tls_ca_file=config.l2_tls_ca_file,
        )
        return SharedL2(ValkeyTier(valkey_settings, namespace, manifest, clock=clock))
    if config.l2_path is None:
        return None
    access = AccessRecorder(config.l2_touch_interval_s)
    profile = get_profile(config.l2_profile)
    direct = profile.direct_reads if config.l2_direct_reads is None else config.l2_direct_reads
    tier = PosixTier(
        config.l2_path,
        namespace,
        manifest,
        exists_ttl_s=config.l2_exists_ttl_s,
        access=access,
        clock=clock,
        file_mode=config.l2_file_mode,
        direct_reads=direct,
        # O_DIRECT pieces at a layer's offset would break a file system's alignment rule
        piece_reads=frozenset() if direct and profile.o_direct_aligned else profile.piece_reads,
    )
    settings = janitor_settings(config)
    janitor = None
    if settings is not None:
        try:
            janitor = Janitor(config.l2_path, settings).start()
        except OSError as exc:
            log.warning(
                "kvtier: L2 janitor not started, this replica does not enforce "
                "l2_capacity_bytes: %s",
                exc,
            )
    return SharedL2(tier, janitor, access)
