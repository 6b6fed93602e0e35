"""Per-file-system L2 profiles and the janitor settings they imply."""

from __future__ import annotations

from typing import get_args

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.settings import L2ProfileName
from kvtier.core.tiers.janitor import JanitorSettings
from kvtier.core.tiers.profiles import PROFILES, get_profile


def test_every_target_file_system_has_a_profile() -> None:
    assert sorted(PROFILES) == ["curvine", "efs", "juicefs", "local", "nfs"]
    assert set(PROFILES) == set(get_args(L2ProfileName))


def test_shared_file_systems_evict_through_a_graveyard_and_local_unlinks_at_once() -> None:
    juicefs = JanitorSettings.for_profile(get_profile("juicefs"), 10**9)
    local = JanitorSettings.for_profile(get_profile("local"), 10**9)
    assert (juicefs.grace_s, juicefs.stale_s, juicefs.lease_ttl_s) == (60.0, 1.0, 30.0)
    assert (local.grace_s, local.stale_s) == (0.0, 0.0)
    assert JanitorSettings.for_profile(get_profile("nfs"), 10**9, grace_s=5.0).grace_s == 5.0


def test_an_unknown_profile_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="l2_profile"):
        get_profile("lustre")
