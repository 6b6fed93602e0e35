"""The router's Prometheus metrics, one registry per router (tests run several in a process).

`ROUTER_METRICS` declares every family (name, type, labels, meaning); `docs/metrics.md` is
rendered from it. The series touched by every request (requests, latencies, decisions, routed,
usage tokens) are plain dict and list updates exported at scrape time: prometheus_client's
`labels()` and locked `observe()` cost ~0.05 ms per request on a slow host, a tenth of the
router's own cost. Gauges are sampled from live state when /metrics is read; the rare paths
(failovers, stream errors, events, purges) use prometheus_client counters.

`ttft_log` keeps the last streamed requests' exact times to first byte (for the dashboard's
exact quantiles; the histogram serves Prometheus).
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvtier.core.metric_defs import LATENCY_BUCKETS, MetricDef
from kvtier.router.replicas import ReplicaSet

__all__ = ["CONTENT_TYPE", "ROUTER_METRICS", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
"""Finer than LATENCY_BUCKETS where TTFTs fall, so quantiles estimated from it stay close."""
TTFT_LOG = 20_000

_REPLICA = ("replica",)
_REPLICAS = "replica: each replica's name (its URL by default)"
_ENDPOINT = "endpoint: the router's paths, `other` for unknown ones"

ROUTER_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "kvtier_router_requests",
        "counter",
        "Requests answered, by HTTP status (499: the client hung up first).",
        ("endpoint", "status"),
        _ENDPOINT + "; status: the HTTP status",
    ),
    MetricDef(
        "kvtier_router_request_seconds",
        "histogram",
        "Arrival to last byte of the answer.",
        ("endpoint",),
        _ENDPOINT,
        LATENCY_BUCKETS,
    ),
    MetricDef(
        "kvtier_router_first_byte_seconds",
        "histogram",
        "Arrival to the first body byte from the replica (any forwarded request).",
        ("endpoint",),
        "endpoint: /v1/completions, /v1/chat/completions",
        LATENCY_BUCKETS,
    ),
    MetricDef(
        "kvtier_router_ttft_seconds",
        "histogram",
        "Time to first token of streamed requests: arrival to the replica's first SSE event.",
        ("endpoint",),
        "endpoint: /v1/completions, /v1/chat/completions",
        TTFT_BUCKETS,
    ),
    MetricDef(
        "kvtier_router_overhead_seconds",
        "histogram",
        "Latency the router adds: arrival to upstream send (parse, tokenize, route).",
        (),
        "",
        LATENCY_BUCKETS,
    ),
    MetricDef(
        "kvtier_router_decisions",
        "counter",
        "Routing decisions, by why the replica was chosen.",
        ("strategy", "reason"),
        "strategy: the router's; reason: prefix-hit, load (spilled off a cached replica), cold, "
        "session, roundrobin",
    ),
    MetricDef(
        "kvtier_router_routed",
        "counter",
        "Attempts sent to each replica (failed-over attempts included).",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_prompt_tokens",
        "counter",
        "Prompt tokens of answered requests, as the replica's `usage` reported them.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_cached_tokens",
        "counter",
        "Prompt tokens the replica served from any cache tier "
        "(`usage.prompt_tokens_details.cached_tokens`; needs `--enable-prompt-tokens-details`).",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_predicted_cached_tokens",
        "counter",
        "Prompt tokens the routing decision expected cached, for the requests counted in "
        "kvtier_router_cached_tokens.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_confirmed_cached_tokens",
        "counter",
        "Per request, the smaller of predicted and reported cached tokens: confirmed / "
        "predicted is the routing accuracy.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_in_flight",
        "gauge",
        "Requests held on a replica (routed, answer not finished).",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_queued_prefill_tokens",
        "gauge",
        "Uncached prompt tokens routed to a replica whose first byte has not come back.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_replica_healthy",
        "gauge",
        "1 while the replica passes health checks, 0 when down or suspect.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_replica_stalls",
        "counter",
        "Times a replica was found stalled: requests without progress, a probe unanswered.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_replica_stopping",
        "counter",
        "Times a replica was found stopping: it refused a request as a draining vLLM does, and "
        "left rotation until it answers a probe completion or its /health fails.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_replica_unreachable",
        "counter",
        "Times requests were given up on a replica that was out of rotation, silent and took no "
        "new connection (a node gone or cut off).",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_failovers",
        "counter",
        "Attempts that failed before the first byte and moved off a replica.",
        _REPLICA,
        _REPLICAS,
    ),
    MetricDef(
        "kvtier_router_stream_errors",
        "counter",
        "Answers cut short after the first byte: streams, and whole answers relayed as they come.",
        ("cause",),
        "cause: upstream (the replica), client (hung up)",
    ),
    MetricDef(
        "kvtier_router_index_blocks",
        "gauge",
        "Entries in a prefix index (its size).",
        ("index",),
        "index: events (KV-event index), routed (what the router routed)",
    ),
    MetricDef(
        "kvtier_router_events",
        "counter",
        "KV events applied to the index.",
        ("source", "kind"),
        "source: kvtier (connector), vllm (engine); kind: stored, removed, cleared, malformed, "
        "gap (a jump in a replica's sequence numbers: events lost before this one; vllm: for "
        "good, no replay filled it), restart (a new epoch or sequence: the tiers that source "
        "announced for the replica dropped); kvtier only: resync (after gaps, one request asking "
        "the replicas that had them for a fresh snapshot of their holdings; rate-limited); "
        "vllm only: "
        "replayed (a lost batch asked back from the replica's replay endpoint and applied), "
        "replay_failed (a replay that failed or timed out)",
    ),
    MetricDef(
        "kvtier_router_index_purges",
        "counter",
        "Replicas purged from the index.",
        ("cause",),
        "cause: down (health checks refused or failed), gone (left the DNS answer)",
    ),
)
DEFS = {d.name: d for d in ROUTER_METRICS}


class HotCounter:
    """A labelled counter for the request path: `inc(*labels)` is one dict update."""

    def __init__(self, definition: MetricDef) -> None:
        self._def = definition
        self.values: dict[tuple[str, ...], int] = {}

    def inc(self, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0) + 1

    def add(self, amount: int, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0) + amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self._def.name, self._def.help, labels=self._def.labels)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        return family


class HotHistogram:
    """A labelled histogram for the request path: `observe(value, *labels)` is one bisect and
    two list updates (per-bucket counts, made cumulative at scrape time)."""

    def __init__(self, definition: MetricDef) -> None:
        self._def = definition
        self.bounds = definition.buckets
        self.series: dict[tuple[str, ...], list[float]] = {}
        """labels -> [count per bucket..., count above the last, sum]"""

    def observe(self, value: float, *labels: str) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        series[bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self._def.name, self._def.help, labels=self._def.labels)
        for labels, series in list(self.series.items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(str, self.bounds), "+Inf"), series[:-1], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(labels, buckets, series[-1])
        return family


USAGE = (
    "kvtier_router_prompt_tokens",
    "kvtier_router_cached_tokens",
    "kvtier_router_predicted_cached_tokens",
    "kvtier_router_confirmed_cached_tokens",
)
"""The usage counters, in the order of `UsageCounters.values`' lists."""


class UsageCounters:
    """The four `USAGE` counters per replica in one list: one dict lookup per request."""

    def __init__(self) -> None:
        self.values: dict[str, list[int]] = {}
        """replica -> [prompt, cached, predicted, confirmed] tokens"""

    def add(self, replica: str, prompt: int, cached: int, predicted: int) -> None:
        v = self.values.get(replica)
        if v is None:
            v = self.values[replica] = [0, 0, 0, 0]
        v[0] += prompt
        v[1] += cached
        v[2] += predicted
        v[3] += min(predicted, cached)

    def families(self) -> Iterator[Metric]:
        for i, name in enumerate(USAGE):
            d = DEFS[name]
            family = CounterMetricFamily(d.name, d.help, labels=d.labels)
            for replica, v in list(self.values.items()):
                family.add_metric((replica,), v[i])
            yield family


class RouterMetrics:
    def __init__(
        self, replicas: ReplicaSet, strategy: str, index_sizes: Callable[[], dict[str, int]]
    ) -> None:
        self.registry = CollectorRegistry()
        self.strategy = strategy
        self._replicas = replicas
        self._index_sizes = index_sizes
        self.requests = HotCounter(DEFS["kvtier_router_requests"])
        self.latency = HotHistogram(DEFS["kvtier_router_request_seconds"])
        self.first_byte = HotHistogram(DEFS["kvtier_router_first_byte_seconds"])
        self.ttft = HotHistogram(DEFS["kvtier_router_ttft_seconds"])
        self.overhead = HotHistogram(DEFS["kvtier_router_overhead_seconds"])
        self.decisions = HotCounter(DEFS["kvtier_router_decisions"])
        self.routed = HotCounter(DEFS["kvtier_router_routed"])
        self.usage = UsageCounters()
        self.ttft_log: deque[tuple[float, float]] = deque(maxlen=TTFT_LOG)
        """(perf_counter at the first byte, TTFT seconds) of the latest streamed requests."""
        self.in_flight = self._gauge("kvtier_router_in_flight")
        self.queued = self._gauge("kvtier_router_queued_prefill_tokens")
        self.healthy = self._gauge("kvtier_router_replica_healthy")
        self.index_blocks = self._gauge("kvtier_router_index_blocks")
        self.failovers = self._counter("kvtier_router_failovers")
        self.stalls = self._counter("kvtier_router_replica_stalls")
        self.stopping = self._counter("kvtier_router_replica_stopping")
        self.unreachable = self._counter("kvtier_router_replica_unreachable")
        self.stream_errors = self._counter("kvtier_router_stream_errors")
        self.events = self._counter("kvtier_router_events")
        self.purges = self._counter("kvtier_router_index_purges")
        self.registry.register(self)  # exports the hot series through collect()

    def _gauge(self, name: str) -> Gauge:
        d = DEFS[name]
        return Gauge(d.name, d.help, d.labels, registry=self.registry)

    def _counter(self, name: str) -> Counter:
        d = DEFS[name]
        return Counter(d.name, d.help, d.labels, registry=self.registry)

    def _hot(self) -> Sequence[HotCounter | HotHistogram]:
        return (
            self.requests,
            self.latency,
            self.first_byte,
            self.ttft,
            self.overhead,
            self.decisions,
            self.routed,
        )

    def observe_ttft(self, seconds: float, endpoint: str, now: float) -> None:
        """A streamed request's first byte came back (`now`: perf_counter)."""
        self.ttft.observe(seconds, endpoint)
        self.ttft_log.append((now, seconds))

    def observe_usage(self, replica: str, predicted: int, prompt: int, cached: int) -> None:
        """What the replica's `usage` said of an answered request, beside the prediction."""
        self.usage.add(replica, prompt, cached, predicted)

    def collect(self) -> Iterator[Metric]:
        for hot in self._hot():
            yield hot.family()
        yield from self.usage.families()

    def forget_replica(self, name: str) -> None:
        """Drop every series of the replica `name` (it left for good): a fleet whose pods come
        and go keeps a bounded set of series."""
        self.routed.values.pop((name,), None)
        self.usage.values.pop(name, None)
        for series in (
            self.in_flight,
            self.queued,
            self.healthy,
            self.failovers,
            self.stalls,
            self.stopping,
            self.unreachable,
        ):
            with contextlib.suppress(KeyError):  # (never given a value for it)
                series.remove(name)

    def sample_gauges(self) -> None:
        """Set the gauges from live state (done at scrape time, not on every change)."""
        for replica in self._replicas:
            self.in_flight.labels(replica.name).set(replica.in_flight)
            self.queued.labels(replica.name).set(replica.queued_prefill_tokens)
            self.healthy.labels(replica.name).set(1 if replica.healthy else 0)
        for name, size in self._index_sizes().items():
            self.index_blocks.labels(name).set(size)

    def render(self) -> bytes:
        """The exposition text."""
        self.sample_gauges()
        return generate_latest(self.registry)
