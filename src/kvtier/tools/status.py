"""`kvtier status`: a running fleet at a glance, in the terminal.

    kvtier status                        the fleet of `kvtier up` (its work_dir/cluster.json)
    kvtier status --url http://HOST:8000 any kvtier router
    kvtier status --watch 2              redraw every 2 s until Ctrl-C

Reads the router's dashboard feed (`GET /dashboard/data/latest`, see `kvtier.router.dashboard`):
the router's own counters and every replica's /metrics, sampled at most a second ago. Prints
the totals (requests, TTFT, cached share, routing accuracy), one row per replica (health, load,
engine and L1 occupancy, prompt tokens by tier) and the shared L2 (usage against capacity and
watermarks, evictions, the janitor's lease holder).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.core.errors import KvtierError

__all__ = ["fetch", "render", "router_url"]

FEED = "/dashboard/data/latest"
CLEAR = "\x1b[H\x1b[2J"


def router_url(args: argparse.Namespace) -> str:
    """The router to ask: --url, else the one recorded by `kvtier up` in its state file."""
    if args.url:
        return str(args.url).rstrip("/")
    from kvtier.tools.cluster.local_fleet import STATE_FILE
    from kvtier.tools.cluster.spec import load_spec
    from kvtier.tools.cluster.state import check_serving

    state = (
        Path(args.state)
        if args.state
        else load_spec(Path(args.config) if args.config else None).work_dir / STATE_FILE
    )
    try:
        recorded = json.loads(state.read_text())
        check_serving(state, recorded)  # (a fleet still starting records no URLs yet)
        return str(recorded["router"]).rstrip("/")
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
        raise KvtierError(
            f"no running fleet recorded in {state} (start one with `kvtier up`, or pass --url)"
        ) from exc


def fetch(url: str, path: str = FEED, timeout_s: float = 10.0) -> dict[str, Any]:
    """The router's dashboard document (`path`: /dashboard/data for the whole history); a
    `KvtierError` naming the URL when no well-formed HTTP answer with JSON comes back (nothing
    listening, another service on the port, a body cut short)."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
            doc: dict[str, Any] = json.load(resp)
    except http.client.HTTPException as exc:
        raise KvtierError(
            f"cannot read {url}{path}: no well-formed HTTP answer "
            f"({type(exc).__name__}: {str(exc).strip()})"
        ) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise KvtierError(f"cannot read {url}{path}: {exc}") from exc
    return doc


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _state(replica: dict[str, Any]) -> str:
    """up, or what keeps it out of rotation in capitals (DOWN, STOPPING, STALLED, LEAVING)."""
    state = str(replica.get("state") or ("up" if replica["healthy"] else "down"))
    return state if state == "up" else state.upper()


def _int(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def render(url: str, doc: dict[str, Any]) -> str:
    """The status screen of one dashboard document."""
    t = doc["totals"]
    when = time.strftime("%H:%M:%S", time.localtime(doc["time"]))
    lines = [
        f"kvtier fleet  {url}  strategy {doc['strategy']}  at {when}",
        f"requests {_int(t['requests'])} (errors {_int(t['errors'])})  ·  TTFT p50 "
        f"{_ms(t['ttft_p50_ms'])}, p90 {_ms(t['ttft_p90_ms'])}  ·  cached share "
        f"{_pct(t['cached_share'])}  ·  routing accuracy {_pct(t['routing_accuracy'])}",
        "",
    ]
    head = [
        "replica",
        "health",
        "in-flight",
        "running",
        "waiting",
        "routed",
        "L0 use",
        "L1 used / capacity",
        "L0 hit",
        "L1 hit",
        "L2 hit",
        "computed",
    ]
    rows = [head]
    for r in doc["replicas"]:
        hits = r.get("hit_ratio") or {}
        l1 = (
            f"{_bytes(r['l1_used_bytes'])} / {_bytes(r['l1_capacity_bytes'])}"
            if r.get("l1_capacity_bytes")
            else "-"
        )
        rows.append(
            [
                r["name"] + (" *" if r.get("lease_held") else ""),
                _state(r) + ("" if r["scraped"] else " (no metrics)"),
                _int(r["in_flight"]),
                _int(r.get("running")),
                _int(r.get("waiting")),
                _int(r["routed"]),
                _pct(r.get("l0_usage")),
                l1,
                *(_pct(hits.get(tier)) for tier in ("l0", "l1", "l2", "computed")),
            ]
        )
    lines.append(table(rows))
    l2 = doc.get("l2")
    if l2:
        share = l2["used_bytes"] / l2["capacity_bytes"] if l2["capacity_bytes"] else None
        lines += [
            "",
            f"L2: {_bytes(l2['used_bytes'])} of {_bytes(l2['capacity_bytes'])} ({_pct(share)}; "
            f"high {_bytes(l2['high_bytes'])}, low {_bytes(l2['low_bytes'])})  ·  "
            f"{_int(l2['blocks'])} blocks  ·  {_int(l2['evicted_blocks'])} evicted  ·  "
            f"janitor (*): {l2['lease_holder'] or 'none'}",
        ]
    else:
        lines += ["", "L2: no capacity-managed shared L2 reported"]
    return "\n".join(lines)


def _screen(url: str) -> str:
    """The status screen of the router at `url`; a `KvtierError` when its dashboard document
    is not one this version reads (another program on the port, another version)."""
    doc = fetch(url)
    try:
        return render(url, doc)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise KvtierError(f"{url}: not a kvtier dashboard document ({exc!r})") from None


def _cmd(args: argparse.Namespace) -> int:
    url = router_url(args)
    shown = 0
    while True:
        text = _screen(url)
        print((CLEAR if args.watch and sys.stdout.isatty() else "") + text, flush=True)
        shown += 1
        if not args.watch or (args.count and shown >= args.count):
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _interval(text: str) -> float:
    """`--watch SECONDS`: a positive, finite number."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return seconds


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "status",
        help="a running fleet at a glance: replicas, health, load, hits by tier, L2",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="a kvtier router's base URL")
    where.add_argument("--config", metavar="FILE", help="the YAML given to `kvtier up`")
    where.add_argument("--state", metavar="FILE", help="a cluster.json written by `kvtier up`")
    p.add_argument(
        "--watch",
        type=_interval,
        nargs="?",
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    p.add_argument("--count", type=int, default=0, help="with --watch: stop after N screens")
    p.set_defaults(func=_cmd)
