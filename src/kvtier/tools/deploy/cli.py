"""`kvtier deploy render`: the Kubernetes overlay of a deployment file (or of a HyperPod
InferenceEndpointConfig)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.tools.cluster.spec import FleetSpec

__all__ = ["load_fleet", "register"]


def load_fleet(path: Path) -> tuple[FleetSpec, list[str]]:
    """The FleetSpec in `path`, and notes: a HyperPod InferenceEndpointConfig is converted."""
    from kvtier.tools.cluster.spec import parse_spec, read_document
    from kvtier.tools.deploy.hyperpod import from_inference_endpoint_config, is_hyperpod

    doc = read_document(path)
    if is_hyperpod(doc):
        return from_inference_endpoint_config(doc)
    return parse_spec(doc), []


def _cmd_render(args: argparse.Namespace) -> int:
    from kvtier.tools.deploy.fleet_name import object_name
    from kvtier.tools.deploy.render import render

    spec, notes = load_fleet(Path(args.config))
    notes += render(spec, Path(args.out))
    for note in notes:
        print(f"kvtier: note: {note}")
    k8s = spec.kubernetes
    router = object_name(spec, "kvtier-router")
    print(f"kvtier: wrote {args.out}/kustomization.yaml ({spec.replicas} replicas, {k8s.device})")
    if not k8s.creates_namespace:
        print(f"  first:   kubectl create namespace {k8s.namespace}   (if it does not exist)")
    print(f"  deploy:  kubectl apply -k {args.out}")
    print(f"  API key: {args.out}/secrets/router-api-keys")
    print(f"  reach:   kubectl -n {k8s.namespace} port-forward svc/{router} 8000:8000")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    deploy = subparsers.add_parser(
        "deploy",
        help="deploy a fleet on Kubernetes",
        description="A kvtier fleet on Kubernetes from the same deployment file `kvtier up` "
        "reads (docs/kubernetes.md).",
    )
    sub = deploy.add_subparsers(dest="deploy_command", metavar="COMMAND", required=True)
    render = sub.add_parser(
        "render",
        help="write the kustomize overlay of a deployment file",
        description="Write a self-contained kustomize overlay (the base manifests, the "
        "components the file needs, generated secrets) for `kubectl apply -k OUT`. The "
        "file is a kvtier deployment file (HyperPod-shaped keys plus `kubernetes:`) or a "
        "SageMaker HyperPod InferenceEndpointConfig; re-rendering keeps the secrets.",
    )
    render.add_argument("--config", required=True, metavar="FILE", help="deployment file")
    render.add_argument("--out", required=True, metavar="DIR", help="overlay directory")
    render.set_defaults(func=_cmd_render)
