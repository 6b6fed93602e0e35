"""The request-path series kept as plain counters: what a Prometheus scrape reads from them."""

from __future__ import annotations

from kvtier.router.metrics import RouterMetrics
from kvtier.router.replicas import ReplicaSet


def sample(text: str, line_start: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(line_start + " ")
    ]
    assert len(values) == 1, (line_start, values)
    return values[0]


def test_hot_histogram_buckets_are_cumulative_with_inclusive_bounds_count_and_sum() -> None:
    metrics = RouterMetrics(ReplicaSet(()), "prefixaware", dict)
    for seconds in (0.0005, 0.0007, 0.003, 500.0):  # on a bound, between two, above the last
        metrics.latency.observe(seconds, "/v1/completions")
    metrics.overhead.observe(0.0002)
    text = metrics.render().decode()
    name = 'kvtier_router_request_seconds_bucket{endpoint="/v1/completions",le='
    assert sample(text, name + '"0.0005"}') == 1  # le is inclusive
    assert sample(text, name + '"0.001"}') == 2
    assert sample(text, name + '"0.002"}') == 2
    assert sample(text, name + '"0.005"}') == 3
    assert sample(text, name + '"120.0"}') == 3
    assert sample(text, name + '"+Inf"}') == 4
    assert sample(text, 'kvtier_router_request_seconds_count{endpoint="/v1/completions"}') == 4
    assert (
        abs(
            sample(text, 'kvtier_router_request_seconds_sum{endpoint="/v1/completions"}') - 500.0042
        )
        < 1e-9
    )
    assert sample(text, 'kvtier_router_overhead_seconds_bucket{le="0.0005"}') == 1
    assert sample(text, "kvtier_router_overhead_seconds_count") == 1


def test_hot_counters_count_per_label_set() -> None:
    metrics = RouterMetrics(ReplicaSet(()), "prefixaware", dict)
    for status in ("200", "200", "400"):
        metrics.requests.inc("/v1/completions", status)
    metrics.routed.inc("r1")
    text = metrics.render().decode()
    assert (
        sample(text, 'kvtier_router_requests_total{endpoint="/v1/completions",status="200"}') == 2
    )
    assert (
        sample(text, 'kvtier_router_requests_total{endpoint="/v1/completions",status="400"}') == 1
    )
    assert sample(text, 'kvtier_router_routed_total{replica="r1"}') == 1
