"""The router's Prometheus metrics, one registry per router (tests run several in a process).

    kvtier_router_requests_total{endpoint,status}      requests answered, by HTTP status
    kvtier_router_request_seconds{endpoint}            arrival to last byte
    kvtier_router_first_byte_seconds{endpoint}         arrival to first byte from the replica
    kvtier_router_overhead_seconds                     arrival to upstream send (parse, tokenize,
                                                       route): the router's own cost
    kvtier_router_in_flight{replica}                   requests held on a replica
    kvtier_router_queued_prefill_tokens{replica}       uncached prompt tokens awaiting first byte
    kvtier_router_replica_healthy{replica}             1 up, 0 down or suspect
    kvtier_router_decisions_total{strategy,reason}     routing decisions by reason
    kvtier_router_routed_total{replica}                attempts sent to each replica
    kvtier_router_failovers_total{replica}             attempts that failed over off a replica
    kvtier_router_stream_errors_total{cause}           streams cut: "upstream" or "client"
    kvtier_router_index_blocks{index}                  entries in a prefix index
    kvtier_router_events_total{source,kind}            KV events applied
    kvtier_router_index_purges_total{cause}            replica purges: restart, cleared, down

The series touched by every request (requests, latency, first byte, overhead, decisions, routed)
are plain dict and list increments exported at scrape time: prometheus_client's `labels()` and
locked `observe()` would cost a noticeable share of the router's own work per request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from kvtier.router.replicas import ReplicaSet

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class HotCounter:
    """A labelled counter for the request path: `inc(*labels)` is one dict update."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self._name, self._doc, self._labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], int] = {}

    def inc(self, *labels: str) -> None:
        self.values[labels] = self.values.get(labels, 0) + 1

    def family(self) -> Metric:
        family = CounterMetricFamily(self._name, self._doc, labels=self._labels)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value)
        return family


class HotHistogram:
    """A labelled histogram for the request path: `observe(value, *labels)` is one bisect and
    two list updates (per-bucket counts, made cumulative at scrape time)."""

    def __init__(
        self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self._name, self._doc, self._labels = name, doc, list(labels)
        self._bounds = tuple(buckets)
        self.series: dict[tuple[str, ...], list[float]] = {}
        """labels -> [count per bucket..., count above the last, sum]"""

    def observe(self, value: float, *labels: str) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = [0.0] * (len(self._bounds) + 2)
        series[bisect_left(self._bounds, value)] += 1
        series[-1] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labels)
        for labels, series in list(self.series.items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(str, self._bounds), "+Inf"), series[:-1], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(labels, buckets, series[-1])
        return family


class RouterMetrics:
    def __init__(
        self, replicas: ReplicaSet, strategy: str, index_sizes: Callable[[], dict[str, int]]
    ) -> None:
        self.registry = CollectorRegistry()
        self.strategy = strategy
        self._replicas = replicas
        self._index_sizes = index_sizes
        r = self.registry
        self.requests = HotCounter(
            "kvtier_router_requests", "Requests answered.", ["endpoint", "status"]
        )
        self.latency = HotHistogram(
            "kvtier_router_request_seconds", "Arrival to last byte.", ["endpoint"], _LATENCY_BUCKETS
        )
        self.first_byte = HotHistogram(
            "kvtier_router_first_byte_seconds",
            "Arrival to first byte from the replica.",
            ["endpoint"],
            _LATENCY_BUCKETS,
        )
        self.overhead = HotHistogram(
            "kvtier_router_overhead_seconds",
            "Arrival to upstream send: parse, tokenize, route.",
            [],
            _LATENCY_BUCKETS,
        )
        self.in_flight = Gauge(
            "kvtier_router_in_flight", "Requests held on a replica.", ["replica"], registry=r
        )
        self.queued = Gauge(
            "kvtier_router_queued_prefill_tokens",
            "Uncached prompt tokens awaiting their first byte.",
            ["replica"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvtier_router_replica_healthy", "1 when the replica is up.", ["replica"], registry=r
        )
        self.decisions = HotCounter(
            "kvtier_router_decisions", "Routing decisions.", ["strategy", "reason"]
        )
        self.routed = HotCounter(
            "kvtier_router_routed", "Attempts sent to each replica.", ["replica"]
        )
        self.failovers = Counter(
            "kvtier_router_failovers",
            "Attempts that failed over off a replica.",
            ["replica"],
            registry=r,
        )
        self.stream_errors = Counter(
            "kvtier_router_stream_errors", "Streams cut short.", ["cause"], registry=r
        )
        self.index_blocks = Gauge(
            "kvtier_router_index_blocks", "Entries in a prefix index.", ["index"], registry=r
        )
        self.events = Counter(
            "kvtier_router_events", "KV events applied.", ["source", "kind"], registry=r
        )
        self.purges = Counter(
            "kvtier_router_index_purges", "Replica purges from the index.", ["cause"], registry=r
        )
        r.register(self)  # exports the hot series through collect()

    def collect(self) -> Iterator[Metric]:
        for hot in (
            self.requests,
            self.latency,
            self.first_byte,
            self.overhead,
            self.decisions,
            self.routed,
        ):
            yield hot.family()

    def render(self) -> bytes:
        """The exposition text; gauges are sampled from live state here, not on every change."""
        for replica in self._replicas:
            self.in_flight.labels(replica.name).set(replica.in_flight)
            self.queued.labels(replica.name).set(replica.queued_prefill_tokens)
            self.healthy.labels(replica.name).set(1 if replica.healthy else 0)
        for name, size in self._index_sizes().items():
            self.index_blocks.labels(name).set(size)
        return generate_latest(self.registry)
