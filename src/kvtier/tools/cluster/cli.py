"""`kvtier up` and `kvtier down`."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path

from kvtier.core.errors import KvtierError, raise_terminated
from kvtier.tools.cluster.spec import load_spec


def _cmd_up(args: argparse.Namespace) -> int:
    from kvtier.tools.cluster.local_fleet import LocalFleet

    spec = load_spec(Path(args.config) if args.config else None)
    if args.replicas is not None:
        spec = spec.replaced(replicas=args.replicas)
    # `kvtier down` sends SIGTERM, which `kvtier.cli.main` raises as a KeyboardInterrupt
    # (`Terminated`), and so is a hangup (its terminal closed) here, unless under nohup: start-up
    # and serving both unwind through LocalFleet.stop().
    hang_up = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    )
    previous = signal.signal(signal.SIGHUP, raise_terminated) if hang_up else None
    try:
        with LocalFleet(spec, monitor=args.monitor) as cluster:
            print(f"kvtier: {spec.replicas} replicas behind the {spec.strategy} router")
            for i, url in enumerate(cluster.replica_urls):
                print(f"  replica {i}: {url}")
            print(f"  L2: {cluster.l2_location or 'disabled'}")
            print(f"  endpoint: {cluster.url}/v1  (model {cluster.model_name!r})")
            print(f"  dashboard: {cluster.url}/dashboard  (`kvtier status` in a terminal)")
            if cluster.prometheus is not None:
                print(f"  prometheus: {cluster.prometheus.url}  (rules: deploy/prometheus/)")
            print("kvtier: Ctrl-C or `kvtier down` stops everything", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("kvtier: stopped", flush=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGHUP, previous)
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from kvtier.tools.cluster.local_fleet import STATE_FILE
    from kvtier.tools.cluster.state import owner_runs, read_state, signal_owner
    from kvtier.tools.vllm_server import STOP_GRACE_S

    spec = load_spec(Path(args.config) if args.config else None)
    state_path = spec.work_dir / STATE_FILE
    state = read_state(state_path)
    pid = signal_owner(state_path, signal.SIGTERM)
    # the router's and the replicas' drains (all at once), then the rest
    limit_s = round(spec.router_drain_s + spec.local.replica_drain_s + STOP_GRACE_S + 60)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and owner_runs(state):
        time.sleep(0.5)
    if owner_runs(state):
        raise KvtierError(f"cluster process {pid} did not stop within {limit_s} s")
    if _records(state_path, pid):
        raise KvtierError(
            f"cluster process {pid} stopped, but not all it started did: {state_path} records "
            "what is left; run `kvtier down` again to stop it"
        )
    print("kvtier: cluster stopped")
    return 0


def _records(state_path: Path, pid: int) -> bool:
    """Whether `state_path` is a state file written by process `pid`."""
    from kvtier.tools.cluster.state import read_state

    try:
        return read_state(state_path).pid == pid
    except KvtierError:
        return False


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = subparsers.add_parser(
        "up",
        help="run a local fleet: N replicas, shared L2, the router",
        description="Start N vLLM replicas with the kvtier connector (each with its own L1, all "
        "sharing one L2), the router in front, and print the endpoint. Runs in the "
        "foreground; Ctrl-C or `kvtier down` stops everything it started.",
    )
    up.add_argument(
        "--config",
        metavar="FILE",
        help="deployment YAML (HyperPod-style keys; see docs/cluster.md)",
    )
    up.add_argument("--replicas", type=int, help="override the number of replicas")
    up.add_argument(
        "--monitor",
        action="store_true",
        help="also run Prometheus (Debian's `prometheus`) scraping the router and every replica "
        "each second, with kvtier's recording and alert rules (docs/observability.md)",
    )
    up.set_defaults(func=_cmd_up)
    down = subparsers.add_parser(
        "down",
        help="stop the fleet started by `kvtier up`",
        description="Ask the running `kvtier up`, starting or serving, to stop and wait. After "
        "a `kvtier up` that was killed, stop the Valkey server, Prometheus and JuiceFS mounts it "
        "left running.",
    )
    down.add_argument("--config", metavar="FILE", help="the same YAML given to `kvtier up`")
    down.set_defaults(func=_cmd_down)
