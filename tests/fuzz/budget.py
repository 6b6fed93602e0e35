"""How many cases the fuzz tests run: a fast fixed-seed set in CI, the full counts with
KVTIER_FUZZ_FULL=1 (docs/security.md: 10,000 router requests, 100,000 mutated blocks and
100,000 mutated KV events)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FULL = os.environ.get("KVTIER_FUZZ_FULL", "") not in ("", "0")


def cases(fast: int, full: int) -> int:
    return full if FULL else fast


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings: fixed seed (derandomized), no example database, no deadline."""
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
