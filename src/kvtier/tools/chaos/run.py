"""Run faults under load and measure what the clients saw (`kvtier bench chaos`).

For each phase (an L2 kind): start the fleet, take the fault-free reference outputs, then for
each of the phase's faults: wait until the fleet is normal, load it for `pre_s`, inject the
fault, hold it, recover, load `post_s` more, and stop the load. A `FaultResult` counts what the
clients saw, split by streaming / not and by started before / after the fault; compares every
answer with the reference; measures the time from the fault's end until serving is normal
again; and checks L2 blocks, processes and mounts against the state before the fault.

"Normal" after a fault: from that moment on, every request succeeds, and among any 5
consecutive requests at most one is slower than the latency bound (3x the median latency before
the fault, at least the slowest request before it). One slow request alone is the noise of a
busy machine (the `control` fault, which injects nothing, shows it); two in five are a pattern.
The strict figure, after the last single slow request, is reported too.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvtier.tools.chaos.faults import Fault
from kvtier.tools.chaos.fleet import ChaosFleet, FleetOptions, PhaseName
from kvtier.tools.chaos.load import Load, Record, RequestKey, prompts_with_shared_prefixes

__all__ = ["WINDOW", "FaultResult", "Timing", "latency_bound", "normal_after", "run_phase", "soak"]

WINDOW = 5
"""Consecutive requests judged together for "normal"; at most one of them may be slow."""


@dataclass(frozen=True, slots=True)
class Timing:
    pre_s: float = 8.0
    """Load before the fault (the baseline latency)."""
    post_s: float = 15.0
    """Load after the fault's end (the recovery is measured in it)."""
    workers: int = 3
    """Concurrent clients."""


@dataclass
class FaultResult:
    fault: str
    phase: str
    what: str
    sent: int = 0
    succeeded: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    """Failures by "<stream|plain> <before|after> <outcome>"."""
    wrong_outputs: int = 0
    hangs: int = 0
    streams_cut_without_error: int = 0
    normal_after_s: float | None = None
    """Seconds from the fault's end until serving was normal (None: not within the run)."""
    last_outlier_after_s: float | None = None
    """The strict figure: seconds from the fault's end until the first request started after
    the last failed or slow one (None: not within the run)."""
    ok_after_end: int = 0
    """Correct answers to requests started after the fault's end (served again at all)."""
    fault_s: float = 0.0
    """From injection to the end of recovery."""
    max_latency_during_s: float = 0.0
    baseline_median_s: float = 0.0
    l2_blocks_before: int = 0
    l2_lost_beyond_failed_part: int = 0
    leaked_processes: list[str] = field(default_factory=list)
    leaked_mounts: list[str] = field(default_factory=list)
    notes: dict[str, object] = field(default_factory=dict)
    timeline: list[tuple[float, float, str, str, int | None]] = field(default_factory=list)
    """Every request: (start in seconds from the injection, latency, outcome or "wrong",
    replica, prompt tokens it served from a cache tier)."""

    def failed_count(self, stream: bool | None = None) -> int:
        return sum(
            n
            for key, n in self.failed.items()
            if stream is None or key.startswith("stream" if stream else "plain")
        )


def _summarize(
    fault: Fault,
    records: list[Record],
    reference: dict[RequestKey, str],
    t_fault: float,
    t_end: float,
) -> FaultResult:
    result = FaultResult(fault.name, fault.phase, fault.what, fault_s=round(t_end - t_fault, 1))
    result.sent = len(records)
    before = [r.ended - r.started for r in records if r.ended < t_fault and r.ok]
    result.baseline_median_s = baseline_median(before)
    bound = latency_bound(before)
    failed: collections.Counter[str] = collections.Counter()
    for r in records:
        if r.ok:
            result.succeeded += 1
            if r.text != reference[r.key]:
                result.wrong_outputs += 1
            continue
        when = "before" if r.started < t_fault else "after"
        failed[f"{'stream' if r.key.stream else 'plain'} {when} {r.outcome}"] += 1
        result.hangs += r.outcome == "hang"
        result.streams_cut_without_error += r.outcome == "stream_cut"
    result.failed = dict(sorted(failed.items()))
    during = [r.ended - r.started for r in records if r.ok and r.started >= t_fault]
    result.max_latency_during_s = round(max(during, default=0.0), 2)
    result.ok_after_end = sum(
        r.ok and r.text == reference[r.key] for r in records if r.started >= t_end
    )
    result.normal_after_s = normal_after(records, t_fault, t_end, bound, WINDOW)
    result.last_outlier_after_s = normal_after(records, t_fault, t_end, bound, 1)
    result.timeline = [
        (
            round(r.started - t_fault, 2),
            round(r.ended - r.started, 2),
            _verdict(r, reference),
            r.replica,
            r.cached_tokens,
        )
        for r in sorted(records, key=lambda r: r.started)
    ]
    result.notes = dict(fault.notes)
    details = sorted({r.detail[:100] for r in records if not r.ok})
    if details:
        result.notes["errors seen"] = details[:3]
    return result


def _verdict(record: Record, reference: dict[RequestKey, str]) -> str:
    """The outcome, with "wrong" for an answer that differs from the reference."""
    if record.ok and record.text != reference[record.key]:
        return "wrong"
    return record.outcome


class Timed(Protocol):
    """What `normal_after` reads of a request."""

    @property
    def started(self) -> float: ...
    @property
    def ended(self) -> float: ...
    @property
    def ok(self) -> bool: ...


def baseline_median(before: list[float]) -> float:
    """The median latency of the requests that ended before a fault, to 10 ms (0 if none)."""
    return round(statistics.median(before), 2) if before else 0.0


def latency_bound(before: list[float]) -> float:
    """The slow-request bound of a fault, from the latencies of the requests that ended before
    it: 3x their `baseline_median`, at least the slowest of them, at least 1 s."""
    return max(3 * baseline_median(before), max(before, default=0.0), 1.0)


def normal_after(
    records: Sequence[Timed], t_fault: float, t_end: float, bound: float, window: int
) -> float | None:
    """Seconds from `t_end` to the start of the first request (started after `t_fault`) from
    which no request fails and no `window` consecutive requests hold two slower than `bound`
    (with `window` 1: none slower); 0.0 if that held throughout, None if no request started
    after the last breach."""
    later = sorted((r for r in records if r.started >= t_fault), key=lambda r: r.started)
    slow = [not r.ok or r.ended - r.started > bound for r in later]
    breaches = [i for i, r in enumerate(later) if not r.ok]
    allowed = 1 if window > 1 else 0
    breaches += [i for i in range(len(later)) if sum(slow[i : i + window]) > allowed]
    if not breaches:
        return 0.0
    resumed = max(breaches) + 1
    if resumed >= len(later):
        return None
    return round(max(0.0, later[resumed].started - t_end), 2)


async def _fault_under_load(
    fleet: ChaosFleet,
    load: Load,
    reference: dict[RequestKey, str],
    fault: Fault,
    timing: Timing,
    log: Any,
) -> FaultResult:
    await asyncio.to_thread(fleet.wait_all_healthy, 300)
    blocks_before = await asyncio.to_thread(fleet.l2_blocks)
    procs_before = collections.Counter(p.split(":", 1)[1] for p in fleet.processes())
    mounts_before = set(fleet.mounts())
    stop = asyncio.Event()
    running = asyncio.create_task(load.run(stop))
    await asyncio.sleep(timing.pre_s)
    log(f"  {fault.name}: injecting ({fault.what})")
    t_fault = time.monotonic()
    await asyncio.to_thread(fault.inject, fleet)
    await asyncio.sleep(fault.hold_s)
    await asyncio.to_thread(fault.recover, fleet)
    t_end = time.monotonic()
    log(f"  {fault.name}: recovered after {t_end - t_fault:.1f} s")
    await asyncio.sleep(timing.post_s)
    stop.set()
    records = await running
    await asyncio.to_thread(fault.restore, fleet)
    await asyncio.to_thread(fleet.wait_all_healthy, 300)
    result = _summarize(fault, records, reference, t_fault, t_end)
    after = await asyncio.to_thread(fleet.l2_blocks)
    result.l2_blocks_before = len(blocks_before)
    result.l2_lost_beyond_failed_part = len(
        blocks_before - after - fault.failed_part(fleet, blocks_before)
    )
    procs_after = collections.Counter(p.split(":", 1)[1] for p in fleet.processes())
    result.leaked_processes = sorted((procs_after - procs_before).elements())
    result.leaked_mounts = sorted(set(fleet.mounts()) - mounts_before)
    return result


def _prompts(fleet: ChaosFleet) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(fleet.running.model)
    return prompts_with_shared_prefixes(tokenizer, 4, 2, 400, 40)


def run_phase(
    phase: PhaseName,
    faults: list[Fault],
    work_dir: Path,
    options: FleetOptions,
    timing: Timing,
    log: Any = print,
) -> tuple[list[FaultResult], dict[str, object]]:
    """Run `faults` (all of `phase`) on one fleet; returns their results and the phase's own
    figures (reference time, leaks after the fleet stopped)."""
    info: dict[str, object] = {"phase": phase}
    results: list[FaultResult] = []
    started = time.monotonic()
    fleet = ChaosFleet(phase, work_dir / phase, options)
    try:
        fleet.start()
        info["fleet_start_s"] = round(time.monotonic() - started, 1)
        log(f"phase {phase}: fleet up in {info['fleet_start_s']} s")
        load = Load(fleet.url, fleet.model_name, _prompts(fleet), workers=timing.workers)
        t0 = time.monotonic()
        reference = asyncio.run(load.reference())
        info["reference_s"] = round(time.monotonic() - t0, 1)
        for fault in faults:
            measured = _fault_under_load(fleet, load, reference, fault, timing, log)
            results.append(asyncio.run(measured))
    finally:
        fleet.stop()
    info["leaked_processes_after_stop"] = fleet.processes()
    info["leaked_mounts_after_stop"] = fleet.mounts()
    info["phase_s"] = round(time.monotonic() - started, 1)
    return results, info


def result_rows(results: list[FaultResult]) -> str:
    """The reliability table (docs/reliability.md's format)."""
    head = (
        "| fault | phase | sent | ok | failed plain before/after | failed stream before/after "
        "| wrong outputs | hangs | cut w/o error event | normal after (s) "
        "| last outlier after (s) | fault (s) "
        "| max latency during (s) | L2 lost beyond failed part | leaks | notes |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for r in results:
        count = _counter(r)
        leaks = len(r.leaked_processes) + len(r.leaked_mounts)
        notes = ", ".join(f"{k} {v}" for k, v in r.notes.items())
        rows.append(
            f"| {r.fault} | {r.phase} | {r.sent} | {r.succeeded} "
            f"| {count('plain before')}/{count('plain after')} "
            f"| {count('stream before')}/{count('stream after')} | {r.wrong_outputs} "
            f"| {r.hangs} | {r.streams_cut_without_error} "
            f"| {_or_dash(r.normal_after_s)} | {_or_dash(r.last_outlier_after_s)} | {r.fault_s} "
            f"| {r.max_latency_during_s} (base {r.baseline_median_s}) "
            f"| {r.l2_lost_beyond_failed_part} of {r.l2_blocks_before} | {leaks} | {notes} |"
        )
    return "\n".join(rows)


def _or_dash(value: float | None) -> str:
    return "-" if value is None else str(value)


def _counter(r: FaultResult) -> Any:
    def count(prefix: str) -> int:
        return sum(n for k, n in r.failed.items() if k.startswith(prefix))

    return count


def as_json(results: list[FaultResult], phases: list[dict[str, object]]) -> dict[str, object]:
    return {"faults": [asdict(r) for r in results], "phases": phases}


# ----- soak -----


def soak(
    work_dir: Path,
    options: FleetOptions,
    faults: list[Fault],
    duration_s: float,
    interval_s: float,
    timing: Timing,
    log: Any = print,
) -> dict[str, object]:
    """`duration_s` of steady load on the juicefs phase's fleet with one of `faults` every
    `interval_s`; samples memory and open files of router and replicas, and the index size,
    every 10 s. Returns the samples and the growth from the first to the last quarter."""
    fleet = ChaosFleet("juicefs", work_dir / "soak", options)
    samples: list[dict[str, float]] = []
    results: list[FaultResult] = []
    try:
        fleet.start()
        load = Load(fleet.url, fleet.model_name, _prompts(fleet), workers=timing.workers)
        reference = asyncio.run(load.reference())
        plan = (faults, duration_s, interval_s, timing)
        asyncio.run(_soak(fleet, load, reference, plan, samples, results, log))
    finally:
        fleet.stop()
    return {
        "samples": samples,
        "growth": _growth(samples),
        "faults": [asdict(r) for r in results],
        "leaked_processes_after_stop": fleet.processes(),
        "leaked_mounts_after_stop": fleet.mounts(),
    }


async def _soak(
    fleet: ChaosFleet,
    load: Load,
    reference: dict[RequestKey, str],
    plan: tuple[list[Fault], float, float, Timing],
    samples: list[dict[str, float]],
    results: list[FaultResult],
    log: Any,
) -> None:
    from kvtier.tools.chaos.faults import INDEX_BLOCKS, router_metric

    faults, duration_s, interval_s, timing = plan
    start = time.monotonic()
    done = asyncio.Event()

    async def sampler() -> None:
        while not done.is_set():
            sample: dict[str, float] = {"t": round(time.monotonic() - start, 1)}
            router = fleet.running.router
            if router is not None:
                rss, fds = fleet.tree_usage(router.pid)
                if rss:  # not while it is down (a fault, a restart)
                    sample.update(router_rss_mib=rss / 2**20, router_fds=fds)
            for i, replica in enumerate(fleet.running.replicas):
                rss, fds = fleet.tree_usage(replica.pid)
                if rss:
                    sample.update({f"replica{i}_rss_mib": rss / 2**20, f"replica{i}_fds": fds})
            sample["index_blocks"] = await asyncio.to_thread(router_metric, fleet, INDEX_BLOCKS)
            samples.append(sample)
            try:
                await asyncio.wait_for(done.wait(), 10)
            except TimeoutError:
                pass

    sampling = asyncio.create_task(sampler())
    i = 0
    while time.monotonic() - start < duration_s:
        fault = faults[i % len(faults)]
        i += 1
        results.append(await _fault_under_load(fleet, load, reference, fault, timing, log))
        idle = interval_s - (timing.pre_s + fault.hold_s + timing.post_s)
        if idle > 0:
            stop = asyncio.Event()
            steady = asyncio.create_task(load.run(stop))
            await asyncio.sleep(min(idle, max(0.0, duration_s - (time.monotonic() - start))))
            stop.set()
            await steady
    done.set()
    await sampling


def _growth(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per series: mean of the last quarter minus mean of the first quarter, over the samples
    that have it (a process is not sampled while it is down)."""
    if len(samples) < 8:
        return {}
    q = len(samples) // 4
    first, last = samples[:q], samples[-q:]
    out = {}
    for key in {key for s in samples for key in s} - {"t"}:
        a = [s[key] for s in first if key in s]
        b = [s[key] for s in last if key in s]
        if a and b:
            out[key] = round(statistics.mean(b) - statistics.mean(a), 1)
    return dict(sorted(out.items()))
