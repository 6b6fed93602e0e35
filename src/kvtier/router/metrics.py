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
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.router.fleet import Fleet

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self, fleet: Fleet, strategy: str,
                 index_sizes: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.strategy = strategy
        self._fleet = fleet
        self._index_sizes = index_sizes
        r = self.registry
        self.requests = Counter("kvtier_router_requests", "Requests answered.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("kvtier_router_request_seconds", "Arrival to last byte.",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("kvtier_router_first_byte_seconds",
                                    "Arrival to first byte from the replica.", ["endpoint"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("kvtier_router_overhead_seconds",
                                  "Arrival to upstream send: parse, tokenize, route.",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kvtier_router_in_flight", "Requests held on a replica.",
                               ["replica"], registry=r)
        self.queued = Gauge("kvtier_router_queued_prefill_tokens",
                            "Uncached prompt tokens awaiting their first byte.", ["replica"],
                            registry=r)
        self.healthy = Gauge("kvtier_router_replica_healthy", "1 when the replica is up.",
                             ["replica"], registry=r)
        self.decisions = Counter("kvtier_router_decisions", "Routing decisions.",
                                 ["strategy", "reason"], registry=r)
        self.routed = Counter("kvtier_router_routed", "Attempts sent to each replica.",
                              ["replica"], registry=r)
        self.failovers = Counter("kvtier_router_failovers",
                                 "Attempts that failed over off a replica.", ["replica"],
                                 registry=r)
        self.stream_errors = Counter("kvtier_router_stream_errors", "Streams cut short.",
                                     ["cause"], registry=r)
        self.index_blocks = Gauge("kvtier_router_index_blocks", "Entries in a prefix index.",
                                  ["index"], registry=r)
        self.events = Counter("kvtier_router_events", "KV events applied.", ["source", "kind"],
                              registry=r)
        self.purges = Counter("kvtier_router_index_purges", "Replica purges from the index.",
                              ["cause"], registry=r)

    def render(self) -> bytes:
        """The exposition text; gauges are sampled from live state here, not on every change."""
        for replica in self._fleet:
            self.in_flight.labels(replica.name).set(replica.in_flight)
            self.queued.labels(replica.name).set(replica.queued_prefill_tokens)
            self.healthy.labels(replica.name).set(1 if replica.healthy else 0)
        for name, size in self._index_sizes().items():
            self.index_blocks.labels(name).set(size)
        return generate_latest(self.registry)
