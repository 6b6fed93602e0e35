"""The rendered CPU fleet run as processes, one emulated node (network namespace) per pod: the
replicas' and the router's command lines, environment and probe paths are the manifest's, so a
wrong flag, variable, port or path in deploy/k8s fails here. A request goes client -> router
pod -> replica pod over real sockets between namespaces; the replicas' connector writes the
shared claim and its KV events, and vLLM's own, reach the router on the rendered ports."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvtier.tools.cluster.spec import parse_spec
from kvtier.tools.deploy.render import EMBEDDED_MODEL, render
from tests.multinode.netns import Network, in_node, require
from tests.tools.deploy.kube import kustomize
from tests.tools.deploy.pods import Pod

pytestmark = pytest.mark.engine

FLEET = {
    "replicas": 2,
    "kvCacheSpec": {"l1CacheSizeGiB": 1, "l2CacheSpec": {"l2CacheSizeGiB": 2}},
    "kubernetes": {"device": "cpu", "routers": 1},
}


def test_a_request_passes_through_the_rendered_router_to_the_rendered_replicas(
    tmp_path: Path, model_dir: str
) -> None:
    require()
    spec = parse_spec(FLEET)
    render(spec, tmp_path / "overlay")
    objects = kustomize(tmp_path / "overlay")
    api_key = (tmp_path / "overlay" / "secrets" / "router-api-keys").read_text().strip()
    images = {EMBEDDED_MODEL: model_dir}
    # the pods' own /tmp, removed after the network has stopped their processes
    with tempfile.TemporaryDirectory(prefix="kvtier-pods-") as temp, Network() as net:
        client = net.node("client")
        nodes = [net.node(f"replica{i}") for i in range(spec.replicas)]
        router_node = net.node("router")
        replicas = [
            Pod(net, n, objects, "kvtier-replica", tmp_path / "volumes", images, Path(temp))
            for n in nodes
        ]
        router = Pod(
            net, router_node, objects, "kvtier-router", tmp_path / "volumes", images, Path(temp)
        )
        dns = {
            "kvtier-replicas": [n.address for n in nodes],
            "kvtier-router": [router_node.address],
        }
        for node in (*nodes, router_node):
            net.hosts(node, dns)
        for pod in replicas:
            pod.start(tmp_path / f"{pod.name}.log")
        router.start(tmp_path / "router.log")
        for pod in replicas:
            pod.wait_probe("startupProbe", client, 600)
            pod.wait_probe("readinessProbe", client, 30)
        router.wait_probe("startupProbe", client, 120)
        router.wait_probe("readinessProbe", client, 60)  # 200 once it found a healthy replica

        served = Path(model_dir).name
        prompt = "The history of the river towns, told slowly and in order. " * 50

        def ask(key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"model": served, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            return httpx.post(
                router.url() + "/v1/completions", json=body, headers=headers, timeout=300
            )

        assert in_node(client, ask, None).result(60).status_code == 401  # the Secret's key rules
        first = in_node(client, ask, api_key).result(320)
        assert first.status_code == 200, first.text
        assert first.headers["x-kvtier-replica"] in {p.url() for p in replicas}
        # the connector (configured by the rendered environment) wrote the shared claim, and
        # its events reached the router through the rendered port
        claim = tmp_path / "volumes" / "claims" / "kvtier-l2"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(claim.rglob("*.kvt")):
            time.sleep(0.5)
        assert list(claim.rglob("*.kvt")), "no L2 block written to the claim"
        metrics = ""
        while time.monotonic() < deadline and 'source="kvtier"' not in metrics:
            metrics = in_node(client, lambda: httpx.get(router.url() + "/metrics").text).result(30)
            time.sleep(0.5)
        assert 'kvtier_router_events_total{kind="stored",source="kvtier"}' in metrics
        # vLLM's own events (the engine's cache, L0) reach it too, on their rendered port
        while time.monotonic() < deadline and 'source="vllm"' not in metrics:
            metrics = in_node(client, lambda: httpx.get(router.url() + "/metrics").text).result(30)
            time.sleep(0.5)
        assert 'kvtier_router_events_total{kind="BlockStored",source="vllm"}' in metrics
        second = in_node(client, ask, api_key).result(320)
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        # the manifest's probes and graceful shutdown hooks name real things
        for pod in (*replicas, router):
            assert pod.container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        print(
            yaml.safe_dump({"router_args": router.argv[1:], "replica_args": replicas[0].argv[1:]})
        )
