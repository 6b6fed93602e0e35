"""One OS process hammering a shared L2 directory (run by tests/tiers/test_posix.py).

    python -m tests.helpers.posix_worker DIR WRITER WRITERS ROUNDS BLOCKS NBYTES SEED

Each round it removes or publishes a random block (its own variant of the bytes) and reads
another, checking the bytes are exactly one writer's variant. At the end it publishes every
block once more and prints a JSON report.
"""

from __future__ import annotations

import json
import random
import sys

from kvtier.core.tiers.posix import PosixTier
from tests.helpers.tiers import NAMESPACE, hash_of, meta_for, variant_payload


def main(argv: list[str]) -> dict[str, int]:
    root, writer, writers, rounds, blocks, nbytes, seed = argv
    me, n_writers, n_bytes = int(writer), int(writers), int(nbytes)
    tier = PosixTier(root, NAMESPACE, {"test": "posix_worker"}, exists_ttl_s=0)
    hashes = [hash_of(f"block-{i}") for i in range(int(blocks))]
    variants = {h: {variant_payload(h, w, n_bytes) for w in range(n_writers)} for h in hashes}
    rng = random.Random(int(seed))
    reads = hits = bad = 0
    for _ in range(int(rounds)):
        h = rng.choice(hashes)
        if rng.random() < 0.25:
            tier.remove(h)
        else:
            tier.put(h, meta_for(n_bytes), variant_payload(h, me, n_bytes))
        h = rng.choice(hashes)
        block = tier.get(h)
        reads += 1
        if block is not None:
            hits += 1
            bad += bytes(block.payload) not in variants[h] or block.meta != meta_for(n_bytes)
    for h in hashes:
        tier.put(h, meta_for(n_bytes), variant_payload(h, me, n_bytes))
    stats = tier.stats()
    return {
        "reads": reads,
        "hits": hits,
        "bad": bad,
        "corrupt_removed": stats.corrupt_removed,
        "errors": stats.errors,
        "stored": stats.stored,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
