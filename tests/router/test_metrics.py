"""The router's metrics: the request-path series kept as plain counters (what a Prometheus
scrape reads from them), the replicas' reported usage beside the routing prediction, and the
declared families (`ROUTER_METRICS`) being exactly what /metrics exports."""

from __future__ import annotations

from kvtier.router.metrics import ROUTER_METRICS, RouterMetrics
from kvtier.router.replicas import ReplicaSet
from kvtier.router.tokenizer import Tokenizer
from kvtier.router.upstream import reported_usage
from tests.helpers.aio import run
from tests.helpers.router import MAX_MODEL_LEN, MODEL, completion, fakes, running_router
from tests.monitoring.fake_vllm import MeteredReplica, metered_fleet


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


# ----- usage, TTFT and the declared families, through a running router -----

VLLM_ANSWER = (
    b'{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"the \\"usage\\": {\\"prompt_tokens\\": 7}"}}],'
    b'"usage":{"prompt_tokens":956,"total_tokens":961,"completion_tokens":5,'
    b'"prompt_tokens_details":{"cached_tokens":896,"created_cache_tokens":0}}}'
)
VLLM_STREAM_TAIL = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],"usage":null}\n\n'
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":956,"total_tokens":961,'
    b'"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":640}}}\n\ndata: [DONE]\n\n'
)


def test_reported_usage_reads_the_last_usage_object_never_text_that_looks_like_one() -> None:
    assert reported_usage(VLLM_ANSWER) == (956, 896)
    assert reported_usage(VLLM_STREAM_TAIL) == (956, 640)
    assert reported_usage(b'{"usage":{"prompt_tokens":12,"total_tokens":14}}') == (12, 0)
    assert reported_usage(b'data: {"choices":[],"usage":null}\n\ndata: [DONE]\n\n') is None
    assert reported_usage(b'data: {"choices":[{"text":"usage"}]}\n\n') is None


def test_the_router_counts_reported_and_predicted_cached_tokens_and_stream_ttft(
    tokenizer: Tokenizer,
) -> None:
    """A streamed answer whose usage event arrives split over two reads, and a plain one."""

    async def scenario() -> None:
        replica = MeteredReplica(
            model=MODEL, max_model_len=MAX_MODEL_LEN, block_tokens=16, prompt_tokens=300
        )
        async with metered_fleet(replica), running_router(tokenizer, [replica]) as rr:
            m = rr.router.metrics
            predictions = []
            for stream in (True, False, True):
                before = m.usage.values.get(replica.url, [0] * 4)[2]
                body = completion("the same prompt " * 20, stream=stream)
                resp = await rr.client.post(rr.url + "/v1/completions", json=body)
                assert resp.status_code == 200
                predictions.append(m.usage.values[replica.url][2] - before)
            text = (await rr.client.get(rr.url + "/metrics")).text
        # the first request was cold; the prefix-aware index knew the repeats' full blocks
        assert predictions[0] == 0 and predictions[1] > 0
        label = f'{{replica="{replica.url}"}}'
        assert sample(text, "kvtier_router_prompt_tokens_total" + label) == 3 * 300
        assert sample(text, "kvtier_router_cached_tokens_total" + label) == 3 * 256
        assert sample(text, "kvtier_router_predicted_cached_tokens_total" + label) == sum(
            predictions
        )
        assert sample(text, "kvtier_router_confirmed_cached_tokens_total" + label) == sum(
            min(p, 256) for p in predictions
        )
        ttft = 'kvtier_router_ttft_seconds_count{endpoint="/v1/completions"}'
        assert sample(text, ttft) == 2  # streams only
        assert len(m.ttft_log) == 2

    run(scenario())


def test_every_declared_family_is_exported_and_nothing_else(tokenizer: Tokenizer) -> None:
    async def scenario() -> str:
        async with fakes("ok") as (a,), running_router(tokenizer, [a]) as rr:
            await rr.client.post(rr.url + "/v1/completions", json=completion())
            return (await rr.client.get(rr.url + "/metrics")).text

    text = run(scenario())
    exported = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert exported == {d.exposed for d in ROUTER_METRICS}


def test_a_replica_that_left_leaves_no_series_behind() -> None:
    """Pods come and go under discovery: each one's series must go with it."""
    metrics = RouterMetrics(ReplicaSet(()), "kvaware", dict)
    for name in ("http://10.0.0.1:8000", "http://10.0.0.2:8000"):
        metrics.routed.inc(name)
        metrics.usage.add(name, 100, 50, 40)
        for series in (metrics.in_flight, metrics.queued, metrics.healthy):
            series.labels(name).set(1)
        for counter in (metrics.failovers, metrics.stalls, metrics.stopping, metrics.unreachable):
            counter.labels(name).inc()
    kept = 'replica="http://10.0.0.2:8000"'
    before = metrics.render().decode()
    assert before.count(kept) == before.count('replica="http://10.0.0.1:8000"') > 0
    metrics.forget_replica("http://10.0.0.1:8000")
    text = metrics.render().decode()
    assert "10.0.0.1" not in text
    assert text.count(kept) == before.count(kept)
