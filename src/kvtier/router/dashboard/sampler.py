"""The fleet as the dashboard shows it: the router's own counters and every replica's /metrics,
sampled every `interval_s` while someone is watching, kept as a short history.

    current()   the latest snapshot as the dashboard's JSON document (sampled now if the last
                one is older than `interval_s`); marks the fleet as watched, which keeps the
                sampling task running until nobody has asked for `idle_stop_s`.

Sampling reads the router's counters in place (no text round trip) and GETs each replica's
/metrics concurrently through the router's one HTTP client, bounded by `timeout_s`; a replica
that does not answer is shown unscraped, not as zeros. Each sample also becomes one point of
the history: rates over the interval (prompt tokens served by tier, requests, decisions, L2
evictions), TTFT p50/p90 of the streamed requests of the last `ttft_window_s`, L2 usage. The
replicas' rates count only the replicas scraped in both samples, and a replica whose counter
went down (a restart) from zero: a missed scrape or a restart is neither a spike nor a dip.

Owner: the router app (`start` after its HTTP pool exists, `stop` on shutdown); runs on the
router's event loop, like everything it reads.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.net.http_client import CONTROL_ANSWER_BYTES, HttpPool
from kvtier.router.dashboard.scrape import replica_figures
from kvtier.router.metrics import RouterMetrics
from kvtier.router.replicas import Replica, ReplicaSet

__all__ = ["DOC_VERSION", "FleetSampler", "Snapshot", "nearest_rank"]

DOC_VERSION = 1
GENERATE = ("/v1/completions", "/v1/chat/completions")
TIERS = ("l0", "l1", "l2", "computed")
L2_FIELDS = ("used_bytes", "capacity_bytes", "high_bytes", "low_bytes", "blocks")


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted `values` (q in 0..100), as the benchmarks compute it."""
    if not values:
        return None
    return values[max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))]


@dataclass(frozen=True, slots=True)
class ReplicaState:
    name: str
    healthy: bool
    state: str
    """`Replica.state`."""
    in_flight: int
    queued_prefill_tokens: int
    figures: Mapping[str, float] | None
    """Its /metrics figures (`scrape.FIGURES`); None when it could not be read."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    wall: float
    """Unix time of the sample."""
    mono: float
    """perf_counter of the sample (the TTFT log's clock)."""
    requests: Mapping[str, int]
    """Generation requests answered, by HTTP status."""
    decisions: Mapping[str, int]
    routed: Mapping[str, int]
    usage: Mapping[str, Mapping[str, int]]
    """prompt, cached, predicted, confirmed -> replica -> tokens (from the router's counters)."""
    replicas: tuple[ReplicaState, ...]
    failovers: int
    point: dict[str, Any] = field(default_factory=dict)
    """This sample's point of the time series (rates since the previous sample)."""

    def fleet_tokens(self) -> dict[str, float] | None:
        """Prompt tokens by tier summed over the replicas that could be scraped."""
        scraped = [r.figures for r in self.replicas if r.figures is not None]
        if not scraped:
            return None
        names = {"prompt": "prompt_tokens", "l0": "l0_tokens", "l1": "l1_tokens", "l2": "l2_tokens"}
        sums = {key: sum(f.get(name, 0.0) for f in scraped) for key, name in names.items()}
        sums["computed"] = max(0.0, sums["prompt"] - sums["l0"] - sums["l1"] - sums["l2"])
        return sums

    def l2(self) -> dict[str, Any] | None:
        """The shared pool's figures (the same on every replica: the largest is the latest)."""
        scraped = [r for r in self.replicas if r.figures is not None]
        if not any("l2_capacity_bytes" in (r.figures or {}) for r in scraped):
            return None
        doc: dict[str, Any] = {}
        for name in L2_FIELDS:
            doc[name] = max((r.figures or {}).get(f"l2_{name}", 0.0) for r in scraped)
        for name in ("evicted_blocks", "evicted_bytes", "corrupt_removed"):
            doc[name] = sum((r.figures or {}).get(f"l2_{name}", 0.0) for r in scraped)
        doc["dropped_writes"] = sum(
            (r.figures or {}).get("l2_dropped_writes", 0.0) for r in scraped
        )
        holders = [r.name for r in scraped if (r.figures or {}).get("l2_lease_held")]
        doc["lease_holder"] = holders[0] if holders else None
        return doc


class FleetSampler:
    def __init__(
        self,
        metrics: RouterMetrics,
        replicas: ReplicaSet,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        history: int = 900,
        idle_stop_s: float = 600.0,
        ttft_window_s: float = 30.0,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.replicas = replicas
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.idle_stop_s = idle_stop_s
        self.ttft_window_s = ttft_window_s
        self._clock = clock
        self._wall = wall
        self.history: deque[Snapshot] = deque(maxlen=history)
        self._pool: HttpPool | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._watched_at = 0.0

    def start(self, pool: HttpPool) -> None:
        self._pool = pool

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def current(self) -> Snapshot:
        """The latest snapshot, at most `interval_s` old; keeps the sampling running."""
        self._watched_at = self._clock()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        async with self._lock:
            latest = self.history[-1] if self.history else None
            if latest is None or self._clock() - latest.mono >= self.interval_s:
                latest = await self._sample()
        return latest

    async def _run(self) -> None:
        while self._clock() - self._watched_at < self.idle_stop_s:
            async with self._lock:
                latest = self.history[-1] if self.history else None
                if latest is None or self._clock() - latest.mono >= self.interval_s * 0.9:
                    await self._sample()
            await asyncio.sleep(self.interval_s)

    # ----- one sample -----

    async def _sample(self) -> Snapshot:
        # the fleet as the sample begins: discovery may add or remove replicas while it waits
        fleet = list(self.replicas)
        pages = await asyncio.gather(*(self._scrape(r) for r in fleet))
        m = self.metrics
        requests: dict[str, int] = {}
        for (endpoint, status), n in list(m.requests.values.items()):
            if endpoint in GENERATE:
                requests[status] = requests.get(status, 0) + n
        per_replica = list(m.usage.values.items())
        usage = {
            kind: {replica: v[i] for replica, v in per_replica}
            for i, kind in enumerate(("prompt", "cached", "predicted", "confirmed"))
        }
        snap = Snapshot(
            wall=self._wall(),
            mono=self._clock(),
            requests=requests,
            decisions={labels[1]: n for labels, n in list(m.decisions.values.items())},
            routed={labels[0]: n for labels, n in list(m.routed.values.items())},
            usage=usage,
            replicas=tuple(
                ReplicaState(
                    r.name, r.healthy, r.state, r.in_flight, r.queued_prefill_tokens, figures
                )
                for r, figures in zip(fleet, pages, strict=True)
            ),
            failovers=int(sum(s.value for s in _samples(m.failovers))),
        )
        snap.point.update(self._point(snap, self.history[-1] if self.history else None))
        self.history.append(snap)
        return snap

    async def _scrape(self, replica: Replica) -> dict[str, float] | None:
        if self._pool is None:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self._pool.get(replica.settings.url, "/metrics")
                try:
                    body = await resp.read(CONTROL_ANSWER_BYTES)
                finally:
                    resp.close()
        except (TimeoutError, OSError):
            return None
        return replica_figures(body) if resp.status == 200 else None

    def _point(self, snap: Snapshot, prev: Snapshot | None) -> dict[str, Any]:
        """The time-series point of `snap`: rates since `prev`, windowed TTFT, L2 usage."""
        point: dict[str, Any] = {"t": round(snap.wall, 3)}
        window = self.ttft_window(snap.mono)
        point["ttft_p50_ms"] = _ms(statistics.median(window) if window else None)
        point["ttft_p90_ms"] = _ms(nearest_rank(window, 90))
        l2 = snap.l2()
        point["l2_used_bytes"] = l2["used_bytes"] if l2 else None
        point["l2_capacity_bytes"] = l2["capacity_bytes"] if l2 else None
        if prev is None:
            return point
        dt = max(snap.mono - prev.mono, 1e-6)

        def rate(now: float, before: float) -> float:
            return round(max(0.0, now - before) / dt, 3)

        tokens = _increases(snap, prev)
        if tokens is not None:
            point["tokens_per_s"] = {t: round(tokens[t] / dt, 3) for t in TIERS}
        point["requests_per_s"] = rate(sum(snap.requests.values()), sum(prev.requests.values()))
        point["decisions_per_s"] = {
            reason: rate(n, prev.decisions.get(reason, 0)) for reason, n in snap.decisions.items()
        }
        if l2 is not None and tokens is not None:
            point["l2_evicted_blocks"] = tokens["l2_evicted_blocks"]
        return point

    def ttft_window(self, now: float) -> list[float]:
        """Sorted TTFTs (seconds) of the streamed requests whose first byte came within
        `ttft_window_s` before `now`."""
        out = []
        for at, seconds in reversed(self.metrics.ttft_log):
            if at < now - self.ttft_window_s:
                break
            if at <= now:
                out.append(seconds)
        return sorted(out)

    # ----- the JSON document -----

    def document(self, snap: Snapshot, points: Iterable[Snapshot]) -> dict[str, Any]:
        """The dashboard's JSON: totals since the router started, the fleet, the L2 pool,
        decisions, and the history points given."""
        usage = {kind: sum(v.values()) for kind, v in snap.usage.items()}
        everything = sorted(seconds for _, seconds in self.metrics.ttft_log)
        ok = snap.requests.get("200", 0)
        totals: dict[str, Any] = {
            "requests": ok,
            "errors": sum(snap.requests.values()) - ok,
            "prompt_tokens": usage["prompt"],
            "cached_tokens": usage["cached"],
            "cached_share": _ratio(usage["cached"], usage["prompt"]),
            "predicted_cached_tokens": usage["predicted"],
            "confirmed_cached_tokens": usage["confirmed"],
            "routing_accuracy": _ratio(usage["confirmed"], usage["predicted"]),
            "ttft_count": len(everything),
            "ttft_p50_ms": _ms(statistics.median(everything) if everything else None),
            "ttft_p90_ms": _ms(nearest_rank(everything, 90)),
            "failovers": snap.failovers,
        }
        fleet = snap.fleet_tokens()
        if fleet is not None:
            totals["tokens"] = {t: fleet[t] for t in TIERS}
            totals["replica_prompt_tokens"] = fleet["prompt"]
        return {
            "version": DOC_VERSION,
            "time": round(snap.wall, 3),
            "interval_s": self.interval_s,
            "ttft_window_s": self.ttft_window_s,
            "strategy": self.metrics.strategy,
            "totals": totals,
            "decisions": dict(snap.decisions),
            "replicas": [self._replica_doc(r, snap) for r in snap.replicas],
            "l2": snap.l2(),
            "series": [s.point for s in points],
        }

    @staticmethod
    def _replica_doc(r: ReplicaState, snap: Snapshot) -> dict[str, Any]:
        f = r.figures or {}
        prompt = snap.usage["prompt"].get(r.name, 0)
        doc: dict[str, Any] = {
            "name": r.name,
            "healthy": r.healthy,
            "state": r.state,
            "scraped": r.figures is not None,
            "in_flight": r.in_flight,
            "queued_prefill_tokens": r.queued_prefill_tokens,
            "routed": snap.routed.get(r.name, 0),
            "prompt_tokens": prompt,
            "cached_tokens": snap.usage["cached"].get(r.name, 0),
            "cached_share": _ratio(snap.usage["cached"].get(r.name, 0), prompt),
            "running": f.get("running"),
            "waiting": f.get("waiting"),
            "l0_usage": f.get("l0_usage"),
            "l1_used_bytes": f.get("l1_used_bytes"),
            "l1_capacity_bytes": f.get("l1_capacity_bytes"),
            "lease_held": bool(f.get("l2_lease_held")) if "l2_lease_held" in f else None,
        }
        if r.figures is not None:
            served = f.get("prompt_tokens", 0.0)
            tiers = {t: f.get(f"{t}_tokens", 0.0) for t in TIERS[:3]}
            tiers["computed"] = max(0.0, served - sum(tiers.values()))
            doc["tokens"] = tiers
            doc["hit_ratio"] = {t: _ratio(v, served) for t, v in tiers.items()}
        return doc


def _increases(snap: Snapshot, prev: Snapshot) -> dict[str, float] | None:
    """What the replicas' counters grew by since `prev`: prompt tokens by tier and L2 blocks
    evicted, summed over the replicas scraped in both samples (None if none was). A counter
    that went down is a restarted replica counting from zero again: its increase is its value
    (as Prometheus's `increase` reads a reset), not a negative that cancels the others'."""
    before = {r.name: r.figures for r in prev.replicas if r.figures is not None}
    both = [(r.figures, before[r.name]) for r in snap.replicas if r.figures and r.name in before]
    if not both:
        return None
    names = ("prompt_tokens", "l0_tokens", "l1_tokens", "l2_tokens", "l2_evicted_blocks")
    out = dict.fromkeys((*TIERS, "l2_evicted_blocks"), 0.0)
    for now, then in both:
        grew = {}
        for name in names:
            value, old = now.get(name, 0.0), then.get(name, 0.0)
            grew[name] = value - old if value >= old else value
        cached = 0.0
        for tier in TIERS[:3]:
            out[tier] += grew[f"{tier}_tokens"]
            cached += grew[f"{tier}_tokens"]
        out["computed"] += max(0.0, grew["prompt_tokens"] - cached)
        out["l2_evicted_blocks"] += grew["l2_evicted_blocks"]
    return out


def _samples(counter: Any) -> list[Any]:
    return [s for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")]


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)
