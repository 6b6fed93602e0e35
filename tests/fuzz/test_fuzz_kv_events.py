"""KV-event messages against mutation: `kvtier.net.kv_events.decode` rejects every frame that is
not exactly a well-formed event with a CodecError (nothing else escapes), and what it accepts
is exactly what the frame says; the vLLM event path (`VllmRehasher`) survives any batch and
keeps its index within bounds.

Byte-level mutations (flips, overwrites, truncations, insertions) and JSON-level ones (a field
removed, added, or replaced by any JSON value, the document wrapped or nested absurdly)."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core.errors import CodecError
from kvtier.core.events import EventKind, KVEvent
from kvtier.core.keys import HASH_BYTES
from kvtier.core.tiers.base import Tier
from kvtier.net.kv_events import decode, encode
from kvtier.router.event_feed import VllmRehasher
from kvtier.router.index import PrefixIndex
from tests.fuzz.budget import cases, fuzz_settings

MUTATIONS_PER_EVENT = 10
EVENTS = cases(300, 10_000)
COUNTS = {"inputs": 0, "accepted": 0}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
events = st.builds(
    KVEvent,
    kind=st.sampled_from(list(EventKind)),
    replica=st.text(min_size=1, max_size=60),
    epoch=st.text(min_size=1, max_size=20),
    tier=st.sampled_from(list(Tier)),
    hashes=st.lists(st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES), max_size=8).map(tuple),
    seq=st.integers(0, 2**63),
)
FIELD_NAMES = ["v", "kind", "replica", "epoch", "tier", "seq", "hashes"]
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(0, 7)),
    st.tuples(st.just("overwrite"), st.integers(0, 2**16), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("truncate"), st.integers(0, 2**16)),
    st.tuples(st.just("insert"), st.integers(0, 2**16), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("replace"), st.sampled_from(FIELD_NAMES), json_values),
    st.tuples(st.just("drop"), st.sampled_from(FIELD_NAMES)),
    st.tuples(st.just("add"), st.text(max_size=8), json_values),
    st.tuples(st.just("hash"), st.text(max_size=40)),
    st.tuples(st.just("wrap"), st.integers(1, 5000)),
)


def _mutate(data: bytes, m: tuple) -> bytes:
    kind = m[0]
    if kind in ("flip", "overwrite", "truncate", "insert"):
        buf = bytearray(data)
        pos = m[1] % (len(buf) + 1)
        if kind == "flip" and pos < len(buf):
            buf[pos] ^= 1 << m[2]
        elif kind == "overwrite":
            buf[pos : pos + len(m[2])] = m[2]
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = m[2]
        return bytes(buf)
    doc = json.loads(data)
    if kind == "replace":
        doc[m[1]] = m[2]
    elif kind == "drop":
        doc.pop(m[1])
    elif kind == "add":
        doc[m[1]] = m[2]
    elif kind == "hash":
        doc["hashes"] = [*doc["hashes"], m[1]]
    elif kind == "wrap":
        return b"[" * m[1] + json.dumps(doc).encode() + b"]" * m[1]
    return json.dumps(doc).encode()


@fuzz_settings(EVENTS)
@given(events, st.lists(mutation, min_size=MUTATIONS_PER_EVENT, max_size=MUTATIONS_PER_EVENT))
def test_a_mutated_event_is_rejected_or_read_exactly(event: KVEvent, mutations) -> None:
    frame = encode(event)
    assert decode(frame) == event
    for m in mutations:
        data = _mutate(frame, m)
        COUNTS["inputs"] += 1
        try:
            got = decode(data)
        except CodecError:
            continue
        COUNTS["accepted"] += 1
        # accepted: the frame is, field for field, the event decode returned
        assert json.loads(data) == json.loads(encode(got)), (m, data)
        assert decode(encode(got)) == got


def test_the_fuzz_ran_its_full_count() -> None:
    assert COUNTS["inputs"] >= EVENTS * MUTATIONS_PER_EVENT


BLOCK = 4
vllm_event = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]),
        "block_hashes": st.lists(
            st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=8), max_size=6
        )
        | json_values,
        "parent_block_hash": st.none()
        | st.integers(0, 2**64 - 1)
        | st.binary(max_size=8)
        | json_values,
        "token_ids": st.lists(st.integers(-(2**40), 2**40), max_size=30) | json_values,
        "block_size": st.integers(-2, 8) | json_values,
        "medium": st.sampled_from([None, "GPU", "CPU", "DISK"]) | json_values,
        "extra_keys": st.none() | json_values,
    },
)


@fuzz_settings(cases(300, 10_000))
@given(st.lists(st.tuples(st.integers(0, 2**63), vllm_event | json_values), max_size=6))
def test_the_vllm_event_path_survives_any_batch(batches) -> None:
    index = PrefixIndex(64)
    rehasher = VllmRehasher("r1", index, max_blocks=64)
    counted: list[tuple[str, str]] = []
    for seq, event in batches:
        payload = msgspec.msgpack.encode([0.0, [event]])
        try:  # the feed's loop catches any Exception per batch: nothing may be a BaseException
            rehasher.apply(seq, payload, 0.0, lambda s, k: counted.append((s, k)))
        except Exception:
            counted.append(("vllm", "malformed"))
    assert index.replicas() <= {"r1"} and len(index) <= 64
    # and it still works: a well-formed batch is indexed
    good = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": BLOCK,
        "medium": "GPU",
    }
    rehasher.apply(2**63 + 1, msgspec.msgpack.encode([0.0, [good]]), 0.0, lambda s, k: None)
    assert "r1" in index.replicas()
