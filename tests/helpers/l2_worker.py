"""A separate process that writes or reads L2 blocks, so tests exercise real cross-process
(and, on two JuiceFS mounts, cross-"node") sharing. Prints one JSON report line on stdout.

    python -m tests.helpers.l2_worker write  BACKEND --seed S --count N --bytes B [--variant V]
    python -m tests.helpers.l2_worker read   BACKEND --seed S --count N --bytes B --variants 0,1
                                        [--seconds T]
    python -m tests.helpers.l2_worker fill   DIR --writer W --bytes B --seconds T --log FILE
                                        [--capacity C --high H --low L --lease-ttl X]
    python -m tests.helpers.l2_worker janitor DIR --capacity C --high H --low L --lease-ttl X
                                        --seconds T

BACKEND is `posix:DIR` or `valkey:URL`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from kvtier.core.keys import ModelIdentity
from kvtier.core.tiers.base import BlockTier
from kvtier.core.tiers.posix import PosixTier
from kvtier.core.tiers.valkey import ValkeyTier, ValkeyTierSettings
from tests.helpers.l2 import IDENTITY, make_block


def open_tier(backend: str, identity: ModelIdentity = IDENTITY) -> BlockTier:
    kind, _, where = backend.partition(":")
    if kind == "posix":
        return PosixTier(where, identity.namespace(), identity.manifest(), exists_ttl_s=0)
    if kind == "valkey":
        return ValkeyTier(
            ValkeyTierSettings(url=where, backoff_initial_s=0.05, backoff_max_s=0.2),
            identity.namespace(),
            identity.manifest(),
        )
    raise SystemExit(f"unknown backend {backend!r}")


def write(args: argparse.Namespace) -> dict[str, object]:
    tier = open_tier(args.backend)
    stored = 0
    for i in range(args.count):
        h, meta, payload = make_block(args.seed, i, args.bytes, args.variant)
        stored += tier.put(h, meta, payload).stored
    s = tier.stats()
    return {"stored": stored, "already_present": s.already_present, "errors": s.errors}


def read(args: argparse.Namespace) -> dict[str, object]:
    """Read every block repeatedly for `seconds` (at least one pass); classify each read."""
    tier = open_tier(args.backend)
    variants = [int(v) for v in args.variants.split(",")]
    expected = {}
    for i in range(args.count):
        blocks = [make_block(args.seed, i, args.bytes, v) for v in variants]
        expected[blocks[0][0]] = {b[2] for b in blocks}
    hits = misses = mismatched = passes = 0
    end = time.monotonic() + args.seconds
    while passes == 0 or time.monotonic() < end:
        passes += 1
        for h, payloads in expected.items():
            got = tier.get(h)
            if got is None:
                misses += 1
            elif bytes(got.payload) in payloads:
                hits += 1
            else:
                mismatched += 1
    s = tier.stats()
    return {
        "hits": hits,
        "misses": misses,
        "mismatched": mismatched,
        "passes": passes,
        "corrupt_removed": s.corrupt_removed,
        "errors": s.errors,
    }


def fill(args: argparse.Namespace) -> dict[str, object]:
    """Write fresh blocks for `seconds`, logging (started, finished, bytes) per publish; with
    `--capacity`, also run a janitor thread as a replica would."""
    from kvtier.core.tiers.janitor import Janitor, JanitorSettings

    tier = open_tier(f"posix:{args.dir}")
    janitor = None
    if args.capacity:
        janitor = Janitor(
            args.dir,
            JanitorSettings(
                capacity_bytes=args.capacity,
                high_watermark=args.high,
                low_watermark=args.low,
                lease_ttl_s=args.lease_ttl,
                interval_s=args.interval,
                grace_s=args.grace,
            ),
            holder=f"writer-{args.writer}",
        )
        janitor.start()
    written = []
    end = time.monotonic() + args.seconds
    i = 0
    try:
        while time.monotonic() < end:
            if args.rate:  # a replica's write rate is bounded by its prefill compute
                time.sleep(max(0.0, (i / args.rate) - (args.seconds - (end - time.monotonic()))))
            h, meta, payload = make_block(1000 + args.writer, i, args.bytes)
            started = time.time()
            if tier.put(h, meta, payload).stored:
                written.append((started, time.time(), len(payload)))
            i += 1
    finally:
        if janitor is not None:
            janitor.close()
    with open(args.log, "w", encoding="utf-8") as log:
        json.dump(written, log)
    return {"written": len(written), "errors": tier.stats().errors}


def janitor(args: argparse.Namespace) -> dict[str, object]:
    """Run only a janitor (a replica that does not write) for `seconds`."""
    from kvtier.core.tiers.janitor import Janitor, JanitorSettings

    j = Janitor(
        args.dir,
        JanitorSettings(
            capacity_bytes=args.capacity,
            high_watermark=args.high,
            low_watermark=args.low,
            lease_ttl_s=args.lease_ttl,
            interval_s=args.interval,
            grace_s=args.grace,
        ),
        holder=args.holder,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # terminate = a clean shutdown
    j.start()
    stop.wait(args.seconds)
    j.close()
    return {"passes": j.passes}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("write", "read"):
        p = sub.add_parser(name)
        p.add_argument("backend")
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--count", type=int, required=True)
        p.add_argument("--bytes", type=int, required=True)
        p.add_argument("--variant", type=int, default=0)
        p.add_argument("--variants", default="0")
        p.add_argument("--seconds", type=float, default=0.0)
    for name in ("fill", "janitor"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--writer", type=int, default=0)
        p.add_argument("--holder", default=f"pid-{os.getpid()}")
        p.add_argument("--bytes", type=int, default=0)
        p.add_argument("--seconds", type=float, required=True)
        p.add_argument("--log", default=os.devnull)
        p.add_argument("--capacity", type=int, default=0)
        p.add_argument("--high", type=float, default=0.9)
        p.add_argument("--low", type=float, default=0.7)
        p.add_argument("--lease-ttl", type=float, default=3.0)
        p.add_argument("--interval", type=float, default=0.1)
        p.add_argument("--grace", type=float, default=0.0)
        p.add_argument("--rate", type=float, default=0.0, help="blocks/s (0: unlimited)")
    args = parser.parse_args()
    report = {"write": write, "read": read, "fill": fill, "janitor": janitor}[args.cmd](args)
    print(json.dumps(report), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
