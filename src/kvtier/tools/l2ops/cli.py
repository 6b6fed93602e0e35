"""`kvtier l2 status|gc|verify`: look after a shared L2 (a directory, or a Valkey URL)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, cast

from kvtier.core.errors import ConfigError, TierError
from kvtier.core.settings import redact_url


def _is_url(target: str) -> bool:
    return "://" in target


def _directory(target: str) -> str:
    """`target`, an existing directory; a `ConfigError` otherwise (nothing is created)."""
    if not os.path.exists(target):
        raise ConfigError(f"{target}: no such L2 directory")
    if not os.path.isdir(target):
        raise ConfigError(f"{target}: not a directory")
    return target


def _report_unreadable(unreadable: list[tuple[str, str]]) -> None:
    for name, why in unreadable:
        print(f"kvtier: cannot read {name}: {why}", file=sys.stderr)


def _janitor(root: str) -> str:
    """Who holds the janitor lease of the L2 directory `root` (read, nothing created)."""
    from kvtier.core.tiers.lease import FileLease
    from kvtier.core.tiers.usage import CONTROL_DIR, control_dir, real_dir

    if not real_dir(root, CONTROL_DIR, "lease"):
        return "none"
    lease = FileLease(
        control_dir(root, "lease"), "status", ttl_s=1, root=root, create=False
    ).current()
    if lease is None:
        return "none"
    return f"{lease.holder} (epoch {lease.epoch}, {'expired' if lease.expired else 'live'})"


@contextmanager
def _reaching(url: str) -> Iterator[None]:
    """Turn a failure to talk to the Valkey at `url` into a `TierError` naming it."""
    import valkey

    try:
        yield
    except (valkey.exceptions.ValkeyError, ValueError) as exc:
        raise TierError(f"{redact_url(url)}: {exc}") from None


def _print(doc: dict[str, object], as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2, default=str))
        return
    for key, value in doc.items():
        print(f"{key:>20}: {value}")


def _status(args: argparse.Namespace) -> int:
    if _is_url(args.target):
        with _reaching(args.target):
            _print(_valkey_status(args.target), args.json)
        return 0
    from kvtier.core.tiers.janitor import read_status
    from kvtier.core.tiers.usage import control_dir, scan

    _directory(args.target)
    usage = scan(args.target, temp_max_age_s=float("inf"), now=time.time())
    unreadable = list(usage.unreadable)
    try:
        janitor = _janitor(args.target)
    except OSError as exc:
        janitor = "?"
        unreadable.append((control_dir(args.target, "lease"), exc.strerror or str(exc)))
    doc: dict[str, object] = {
        "blocks": len(usage.blocks),
        "block_bytes": usage.block_bytes,
        "in_flight_bytes": usage.temp_bytes,
        "graveyard_bytes": sum(e.size for e in usage.graveyard),
        "janitor": janitor,
        "last_pass": read_status(args.target),
        "unreadable": len(unreadable),
    }
    _report_unreadable(unreadable)
    _print(doc, args.json)
    return 1 if unreadable else 0


def _valkey_status(url: str) -> dict[str, object]:
    """The server's memory, keys and evictions; a cluster's summed over its primaries."""
    from kvtier.core.tiers.valkey import shard_clients

    with shard_clients(url) as clients:
        memory = [cast("dict[str, Any]", c.info("memory")) for c in clients]
        stats = [cast("dict[str, Any]", c.info("stats")) for c in clients]
        return {
            "servers": len(clients),
            "used_memory": sum(m["used_memory"] for m in memory),
            "maxmemory": sum(m["maxmemory"] for m in memory),
            "policy": ",".join(sorted({str(m["maxmemory_policy"]) for m in memory})),
            "keys": sum(cast("int", c.dbsize()) for c in clients),
            "evicted_keys": sum(s["evicted_keys"] for s in stats),
        }


def _gc(args: argparse.Namespace) -> int:
    from kvtier.core.tiers.janitor import Janitor, JanitorSettings
    from kvtier.core.tiers.profiles import get_profile

    if _is_url(args.target):
        raise ConfigError(
            f"{redact_url(args.target)}: gc runs on an L2 directory (Valkey evicts by itself)"
        )
    _directory(args.target)

    config = JanitorSettings.for_profile(
        get_profile(args.profile),
        args.capacity,
        high_watermark=args.high,
        low_watermark=args.low,
        interval_s=1.0,
    )
    try:
        janitor = Janitor(args.target, config, holder=f"kvtier-l2-gc:{time.time():.0f}")
        try:
            report = janitor.run_once(force_low=args.to_low)
        finally:
            janitor.close()
    except OSError as exc:
        raise ConfigError(f"{exc.filename or args.target}: {exc.strerror or exc}") from None
    if report is None:
        holder = janitor.lease.current()
        if holder is None or holder.expired:  # the lease is free, yet not ours: logged why
            raise ConfigError(f"{janitor.lease.directory}: cannot take the janitor lease")
        print(f"another janitor holds the lease: {holder.holder}; it enforces the capacity already")
        return 1
    _print(asdict(report), args.json)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from kvtier.tools.l2ops.verify import verify_directory, verify_valkey

    if _is_url(args.target):
        with _reaching(args.target):
            report = verify_valkey(args.target, remove=args.remove)
    else:
        report = verify_directory(_directory(args.target), remove=args.remove)
    for name, why in report.bad:
        print(f"BAD {name}: {why}")
    _report_unreadable(report.unreadable)
    _print(
        {
            "checked": report.checked,
            "bad": len(report.bad),
            "removed": report.removed,
            "unreadable": len(report.unreadable),
        },
        args.json,
    )
    return 1 if report.unreadable or len(report.bad) > report.removed else 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    l2 = subparsers.add_parser(
        "l2",
        help="inspect and maintain the shared L2 (status, gc, verify)",
        description="Look after a shared L2: a directory on a shared mount, or a Valkey URL "
        "(redis://host:port[/db]).",
    )
    sub = l2.add_subparsers(dest="l2_command", metavar="ACTION", required=True)

    status = sub.add_parser(
        "status",
        help="usage, janitor lease holder, last janitor pass",
        description="Show what the L2 holds and who enforces its capacity.",
    )
    status.add_argument("target", help="L2 directory or Valkey URL")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=_status)

    gc = sub.add_parser(
        "gc",
        help="run one janitor pass now",
        description="Take the janitor lease (unless a live janitor holds it), "
        "evict least-recently-used blocks per the watermarks, purge "
        "the graveyard and orphaned temp files, release the lease.",
    )
    gc.add_argument("target", help="L2 directory")
    gc.add_argument("--capacity", required=True, help="capacity of the directory, e.g. 500G")
    gc.add_argument("--high", type=float, default=0.9, help="high watermark (fraction)")
    gc.add_argument("--low", type=float, default=0.75, help="low watermark (fraction)")
    gc.add_argument(
        "--profile", default="local", help="file system profile: local, juicefs, curvine, nfs, efs"
    )
    gc.add_argument(
        "--to-low",
        action="store_true",
        help="evict down to the low watermark even below the high one",
    )
    gc.add_argument("--json", action="store_true", help="print JSON")
    gc.set_defaults(func=_gc)

    verify = sub.add_parser(
        "verify",
        help="check every object's header and checksum",
        description="Read every stored block and validate it; exit 1 if any "
        "is bad (unless --remove removed them).",
    )
    verify.add_argument("target", help="L2 directory or Valkey URL")
    verify.add_argument("--remove", action="store_true", help="delete bad objects")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.set_defaults(func=_verify)
