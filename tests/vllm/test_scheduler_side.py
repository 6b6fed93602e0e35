"""The scheduler side's decisions, driven like vLLM's scheduler drives them (no engine): lookups
answer None until done, count only full blocks short of the last token, and plans name exact
block hashes and engine block ids."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtier.core.codec import BlockMeta
from kvtier.core.events import EventKind
from kvtier.core.keys import BlockHash, ModelIdentity, block_hashes, extra_key, root_hash
from kvtier.core.tiers.base import Tier
from kvtier.vllm import process_store
from kvtier.vllm.metadata import KvtierWorkerMeta
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.settings import ConnectorSettings
from kvtier.vllm.stats import ConnectorCounters

BLOCK, ENGINE = 256, 128


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class FakeSchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str] | None = None


@pytest.fixture
def rt() -> Iterator[process_store.ProcessStore]:
    identity = ModelIdentity(model="unit", kv_layout="test", block_tokens=BLOCK)
    shared = process_store.acquire(ConnectorSettings(l1_bytes=1 << 20), identity, publish=False)
    yield shared
    process_store.release(shared)


def _side(
    rt: process_store.ProcessStore,
    block_ids: dict[str, list[int]] | None = None,
    counters: ConnectorCounters | None = None,
    load_async: bool = True,
    **options: float,
) -> SchedulerSide:
    return SchedulerSide(
        [rt],
        BLOCK,
        ENGINE,
        lookup_ttl_s=10.0,
        counters=counters or ConnectorCounters(),
        events=False,
        block_ids_of=lambda r: (block_ids or {}).get(r, []),
        load_async=load_async,
        **options,  # type: ignore[arg-type]
    )


def _store_blocks(
    rt: process_store.ProcessStore,
    tokens: list[int],
    n: int,
    salt: str | None = None,
    missing: Collection[int] = (),
) -> None:
    """Store the first `n` blocks of `tokens`, but those at the positions in `missing`."""
    extra = extra_key(cache_salt=salt) if salt else b""
    parent = root_hash(extra)
    for i, h in enumerate(block_hashes(tokens, BLOCK, extra)[:n]):
        if i not in missing:
            meta = BlockMeta(num_tokens=BLOCK, dtype="uint8", shape=(8,), parent=parent)
            rt.store.save(h, meta, bytes(8))
        parent = h


def _answer(side: SchedulerSide, request: FakeRequest, local: int) -> tuple[int | None, bool]:
    """Ask until the lookup has finished, as vLLM re-asks on each step."""
    first = side.matched_tokens(request, local)  # type: ignore[arg-type]
    assert first == (None, False)
    for _ in range(100):
        answer = side.matched_tokens(request, local)  # type: ignore[arg-type]
        if answer[0] is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("lookup never finished")


def test_lookup_answers_none_first_then_full_blocks_short_of_the_last_token(
    rt: process_store.ProcessStore,
) -> None:
    tokens = list(range(1024))
    _store_blocks(rt, tokens, 4)  # all four blocks are cached...
    side = _side(rt)
    try:
        request = FakeRequest("r1", tokens)
        side.new_request(request)  # type: ignore[arg-type]
        # ...but the last token must be computed: 3 blocks are offered, loaded asynchronously.
        assert _answer(side, request, 0) == (768, True)
        assert _answer(side, FakeRequest("r2", tokens), 256) == (512, True)
    finally:
        side.close()


def test_only_the_contiguous_prefix_counts(rt: process_store.ProcessStore) -> None:
    tokens = list(range(1300))
    hashes = block_hashes(tokens, BLOCK)
    _store_blocks(rt, tokens, 2)
    rt.store.save(
        hashes[3],
        BlockMeta(num_tokens=BLOCK, dtype="uint8", shape=(8,), parent=hashes[2]),
        bytes(8),
    )  # block 2 is missing
    side = _side(rt)
    try:
        assert _answer(side, FakeRequest("r", tokens), 0) == (512, True)
    finally:
        side.close()


@pytest.mark.parametrize(
    ("stored", "missing", "found", "most_checks"),
    [
        (32, (), 32, 2),  # the first block, then the last: all held
        (20, (), 20, 2 + 5),  # then bisection of blocks 1-30
        (32, (10,), 32, 2),  # a hole is taken for held: its load fails, recomputed
        (0, (), 0, 1),  # a cold prompt costs one check
    ],
)
def test_a_lookup_bisects_instead_of_checking_every_block(
    rt: process_store.ProcessStore,
    monkeypatch: pytest.MonkeyPatch,
    stored: int,
    missing: tuple[int, ...],
    found: int,
    most_checks: int,
) -> None:
    tokens = list(range(32 * BLOCK + 1))  # 32 blocks before the last token
    hashes = block_hashes(tokens, BLOCK)
    _store_blocks(rt, tokens, stored, missing=missing)
    checked: list[int] = []
    contains = rt.store.contains

    def counted(block_hash: BlockHash) -> Tier | None:
        checked.append(hashes.index(block_hash))
        return contains(block_hash)

    monkeypatch.setattr(rt.store, "contains", counted)
    side = _side(rt)
    try:
        matched, _ = _answer(side, FakeRequest("r", tokens), 0)
        assert matched == found * BLOCK
        assert checked[0] == 0 and len(checked) <= most_checks, checked
    finally:
        side.close()


def test_no_lookup_when_l0_already_covers_every_offerable_block(
    rt: process_store.ProcessStore,
) -> None:
    side = _side(rt)
    try:
        request = FakeRequest("r", list(range(600)))
        assert side.matched_tokens(request, 512) == (0, False)  # type: ignore[arg-type]
    finally:
        side.close()


def test_a_salted_request_does_not_hit_unsalted_or_other_salts_blocks(
    rt: process_store.ProcessStore,
) -> None:
    tokens = list(range(800))
    _store_blocks(rt, tokens, 3, salt="tenant-a")
    side = _side(rt)
    try:
        assert _answer(side, FakeRequest("plain", tokens), 0) == (0, False)
        assert _answer(side, FakeRequest("b", tokens, cache_salt="tenant-b"), 0) == (0, False)
        assert _answer(side, FakeRequest("a", tokens, cache_salt="tenant-a"), 0) == (768, True)
    finally:
        side.close()


def test_load_plan_skips_engine_blocks_l0_already_holds(rt: process_store.ProcessStore) -> None:
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 4)
    side = _side(rt)
    try:
        request = FakeRequest("r", tokens)
        side.new_request(request)  # type: ignore[arg-type]
        assert _answer(side, request, 128) == (896, True)  # L0 holds engine block 0
        blocks = FakeBlocks([10, 11, 12, 13, 14, 15, 16, 17])
        side.after_alloc(request, blocks, 896)  # type: ignore[arg-type]
        meta = side.build_meta(FakeSchedulerOutput({}))  # type: ignore[arg-type]
        (load,) = meta.loads
        assert load.hashes == tuple(block_hashes(tokens, BLOCK)[:4])
        assert load.skip == 1
        assert load.engine_block_ids == (11, 12, 13, 14, 15, 16, 17)
        assert side.hit_tokens(request) == {Tier.L1: 896}  # type: ignore[arg-type]
        assert meta.saves == []
    finally:
        side.close()


def test_saves_are_planned_for_blocks_each_step_completes(rt: process_store.ProcessStore) -> None:
    tokens = list(range(700))
    side = _side(rt, {"r": list(range(20, 26))})
    try:
        request = FakeRequest("r", tokens)
        side.new_request(request)  # type: ignore[arg-type]
        meta = side.build_meta(FakeSchedulerOutput({"r": 300}))  # type: ignore[arg-type]
        (save,) = meta.saves
        hashes = block_hashes(tokens, BLOCK)
        assert save.hashes == (hashes[0],)
        assert save.parents == (root_hash(),)
        assert save.engine_block_ids == (20, 21)
        request.num_computed_tokens = 300
        meta = side.build_meta(FakeSchedulerOutput({"r": 400}))  # type: ignore[arg-type]
        (save,) = meta.saves
        assert save.hashes == (hashes[1],)  # the 188 tail tokens are never a block
        assert save.parents == (hashes[0],)
        assert save.engine_block_ids == (22, 23)
        assert side.finished(request) is True  # type: ignore[arg-type]
    finally:
        side.close()


def test_a_long_l0_hit_offers_only_the_blocks_computed_after_it(
    rt: process_store.ProcessStore,
) -> None:
    """vLLM's prefix cache (L0) supplied 255 blocks: the requests that computed them offered
    them; the first step offers the 2 blocks it computes (not 257, past the saver's backlog)."""
    tokens = list(range(257 * BLOCK + 50))
    side = _side(rt, {"r": list(range(600))})
    try:
        request = FakeRequest("r", tokens, num_computed_tokens=255 * BLOCK)
        side.new_request(request)  # type: ignore[arg-type]
        meta = side.build_meta(FakeSchedulerOutput({"r": len(tokens) - 255 * BLOCK}))  # type: ignore[arg-type]
        (save,) = meta.saves
        assert save.hashes == tuple(block_hashes(tokens, BLOCK)[255:257])
        assert save.first_index == 255 and save.reused_blocks == 255
        assert save.engine_block_ids == (510, 511, 512, 513)
        request.num_computed_tokens = len(tokens)
        assert side.build_meta(FakeSchedulerOutput({"r": 1})).saves == []  # type: ignore[arg-type]
    finally:
        side.close()


def test_a_lookup_past_its_deadline_answers_0_and_none_queues_behind_it(
    rt: process_store.ProcessStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An L2 existence check that never returns (a stalled mount): the request is computed
    once the deadline passed, and later requests are answered 0 at once."""
    stall = threading.Event()

    def hung(block_hash: BlockHash) -> Tier | None:
        stall.wait(30)
        return None

    monkeypatch.setattr(rt.store, "contains", hung)
    counters = ConnectorCounters()
    side = _side(rt, counters=counters, lookup_deadline_s=0.2)
    try:
        first = FakeRequest("r1", list(range(1000)))
        assert side.matched_tokens(first, 0) == (None, False)  # type: ignore[arg-type]
        time.sleep(0.3)
        assert side.matched_tokens(first, 0) == (0, False)  # type: ignore[arg-type]
        later = FakeRequest("r2", list(range(5000, 6000)))
        assert side.matched_tokens(later, 0) == (0, False)  # type: ignore[arg-type]
        assert counters.totals()["lookup_deadline_missed"] == 2
        stall.set()  # the mount is back: once the hung lookup ends, lookups run again
        deadline = time.monotonic() + 10
        while counters.totals().get("lookups", 0) < 1:
            assert time.monotonic() < deadline, "the hung lookup never ended"
            time.sleep(0.01)
        assert _answer(side, FakeRequest("r3", list(range(7000, 8000))), 0) == (0, False)
        assert counters.totals()["lookup_deadline_missed"] == 2
    finally:
        stall.set()
        side.close()


def test_l1_mirror_makes_a_worker_process_l1_visible(rt: process_store.ProcessStore) -> None:
    tokens = list(range(600))
    hashes = block_hashes(tokens, BLOCK)
    side = _side(rt)
    try:
        side.apply_worker_meta(KvtierWorkerMeta([(0, (EventKind.STORED, tuple(hashes)))]))
        assert _answer(side, FakeRequest("r1", tokens), 0) == (512, True)
        side.apply_worker_meta(KvtierWorkerMeta([(0, (EventKind.REMOVED, (hashes[1],)))]))
        assert _answer(side, FakeRequest("r2", tokens), 0) == (256, True)
    finally:
        side.close()


def test_a_fast_lookup_is_answered_in_the_same_step_when_a_wait_is_allowed(
    rt: process_store.ProcessStore,
) -> None:
    tokens = list(range(5 * BLOCK))
    _store_blocks(rt, tokens, 3)
    side = _side(rt, lookup_wait_s=5.0)
    assert side.matched_tokens(FakeRequest("r1", tokens), 0) == (3 * BLOCK, True)  # type: ignore[arg-type]
    side.close()


def test_lookups_and_plans_are_timed(rt: process_store.ProcessStore) -> None:
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 4)
    counters = ConnectorCounters()
    side = _side(rt, counters=counters)
    try:
        request = FakeRequest("r", tokens)
        before = time.monotonic()
        assert _answer(side, request, 0) == (1024, True)
        side.after_alloc(request, FakeBlocks(list(range(8))), 1024)  # type: ignore[arg-type]
        (load,) = side.build_meta(FakeSchedulerOutput({})).loads  # type: ignore[arg-type]
        assert load.planned_at is not None and before <= load.planned_at <= time.monotonic()
        totals = counters.totals()
        assert totals["lookup_deferred"] >= 1  # lookup_wait_s=0: the first ask is deferred
        assert totals["phase_lookup_seconds"] > 0
        assert totals["phase_lookup_wait_seconds"] >= totals["phase_lookup_seconds"]
    finally:
        side.close()


def test_blocks_planned_from_l2_are_marked_for_promotion_in_the_save_plan(
    tmp_path: Path,
) -> None:
    tokens = list(range(1100))
    config = ConnectorSettings(l1_bytes=1 << 20, l2_path=str(tmp_path))
    identity = ModelIdentity(model="unit-l2", kv_layout="test", block_tokens=BLOCK)
    writer = process_store.acquire(config, identity, publish=False)
    try:
        _store_blocks(writer, tokens, 4)
        assert writer.store.flush(30)
    finally:
        process_store.release(writer)
    reader = process_store.acquire(config, identity, publish=False)  # a fresh, empty L1
    side = _side(reader, {"r": list(range(10))})
    try:
        request = FakeRequest("r", tokens)
        side.new_request(request)  # type: ignore[arg-type]
        assert _answer(side, request, 256) == (768, True)  # L0 holds block 0; 1-3 in L2
        side.after_alloc(request, FakeBlocks(list(range(10))), 768)  # type: ignore[arg-type]
        assert side.hit_tokens(request) == {Tier.L2: 768}  # type: ignore[arg-type]
        request.num_computed_tokens = 1024
        meta = side.build_meta(FakeSchedulerOutput({"r": 76}))  # type: ignore[arg-type]
        (save,) = meta.saves
        assert save.hashes == tuple(block_hashes(tokens, BLOCK)[1:4])  # not the L0 hit
        assert save.first_index == 1 and save.engine_block_ids == tuple(range(2, 8))
        assert save.promote == frozenset({0, 1, 2})
    finally:
        side.close()
        process_store.release(reader)


def test_blocks_vllm_recomputes_after_a_failed_load_are_offered_again(
    rt: process_store.ProcessStore,
) -> None:
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 4)
    side = _side(rt, {"r": list(range(10))})
    try:
        request = FakeRequest("r", tokens)
        side.new_request(request)  # type: ignore[arg-type]
        assert _answer(side, request, 0) == (1024, True)
        side.after_alloc(request, FakeBlocks(list(range(10))), 1024)  # type: ignore[arg-type]
        request.num_computed_tokens = 1024
        meta = side.build_meta(FakeSchedulerOutput({"r": 76}))  # type: ignore[arg-type]
        (save,) = meta.saves  # the step that loads: its worker drops what failed to load
        hashes = block_hashes(tokens, BLOCK)
        assert save.hashes == tuple(hashes[:4])
        # block 2 failed to load: vLLM goes back to it and recomputes from there
        request.num_computed_tokens = 512
        meta = side.build_meta(FakeSchedulerOutput({"r": 588}))  # type: ignore[arg-type]
        (save,) = meta.saves
        assert save.hashes == tuple(hashes[2:4])
        assert save.parents == (hashes[1], hashes[2])
        assert save.engine_block_ids == (4, 5, 6, 7)
        assert save.reused_blocks == 2  # the recomputed blocks are no hits
        request.num_computed_tokens = 1100
        assert side.build_meta(FakeSchedulerOutput({"r": 1})).saves == []  # type: ignore[arg-type]
    finally:
        side.close()


@pytest.mark.parametrize("batches_in_flight", [1, 2])
def test_a_save_plan_names_the_recently_loaded_blocks_its_blocks_were_computed_from(
    rt: process_store.ProcessStore, batches_in_flight: int
) -> None:
    """ "a" loads 4 blocks synchronously into engine blocks 0-7; "b" found them in vLLM's prefix
    cache and computes its fifth block in the same step: b's plan names blocks 0-7 as
    `loaded_before`, and so does the next step's plan while it may have been scheduled before
    vLLM saw the load's outcome (two batches in flight), then no more."""
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 4)
    side = _side(
        rt,
        {"a": list(range(10)), "b": [*range(8), *range(20, 30)]},
        load_async=False,
        batches_in_flight=batches_in_flight,
    )
    try:
        a, b = FakeRequest("a", tokens), FakeRequest("b", tokens[:1024] + [7] * 1100)
        for request in (a, b):
            side.new_request(request)  # type: ignore[arg-type]
        assert _answer(side, a, 0) == (1024, False)
        side.after_alloc(a, FakeBlocks(list(range(10))), 1024)  # type: ignore[arg-type]
        a.num_computed_tokens = b.num_computed_tokens = 1024
        meta = side.build_meta(FakeSchedulerOutput({"a": 76, "b": 256}))  # type: ignore[arg-type]
        saves = {s.req_id: s for s in meta.saves}
        assert saves["a"].loaded_before == frozenset()  # its loaded blocks are its own offer
        assert saves["b"].loaded_before == frozenset(range(8))
        assert saves["b"].engine_block_ids == (20, 21)
        b.num_computed_tokens = 1280
        (save,) = side.build_meta(FakeSchedulerOutput({"b": 512})).saves  # type: ignore[arg-type]
        assert save.engine_block_ids == (22, 23, 24, 25)
        assert save.loaded_before == (frozenset(range(8)) if batches_in_flight == 2 else set())
        b.num_computed_tokens = 1792
        (save,) = side.build_meta(FakeSchedulerOutput({"b": 256})).saves  # type: ignore[arg-type]
        assert save.engine_block_ids == (26, 27) and save.loaded_before == frozenset()
    finally:
        side.close()


def test_a_lora_request_is_keyed_by_its_adapters_name_and_path() -> None:
    """As vLLM keys it: an adapter name pointed at new weights (another path) never finds the
    blocks computed with the old ones; the router hashes with the same key."""
    from vllm.lora.request import LoRARequest

    from kvtier.vllm import compat

    def extra(path: str) -> bytes:
        request = FakeRequest("r", [1], lora_request=LoRARequest("sql", 1, path))
        return compat.request_extra(request)  # type: ignore[arg-type]

    assert extra("/adapters/sql-v1") == extra_key(lora="sql", lora_path="/adapters/sql-v1")
    assert extra("/adapters/sql-v1") != extra("/adapters/sql-v2")
    assert extra_key(lora="sql") != extra("/adapters/sql-v1") != extra_key()


def test_a_prompt_with_embeddings_mixed_in_is_neither_looked_up_nor_saved(
    rt: process_store.ProcessStore,
) -> None:
    """vLLM puts 0 at the embedded positions of a mixed prompt's token ids: two requests with
    the same text and other embeddings would name the same blocks, and one would load the
    other's KV."""
    tokens = [0] * 512 + list(range(600))
    _store_blocks(rt, tokens, 4)  # blocks of the same token ids, computed with other embeddings
    side = _side(rt, {"e": list(range(10))})
    try:
        request = FakeRequest("e", tokens, prompt_embeds=object())
        assert side.matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
        side.new_request(request)  # type: ignore[arg-type]
        assert not side.build_meta(FakeSchedulerOutput({"e": 1112})).saves  # type: ignore[arg-type]
        plain = FakeRequest("p", tokens)
        assert _answer(side, plain, 0)[0] == 1024  # the same ids without embeddings: a hit
    finally:
        side.close()


def test_a_preempted_request_no_longer_holds_its_blocks_for_dropped_saves(
    rt: process_store.ProcessStore,
) -> None:
    """Its saves were dropped with its blocks at the preemption: finishing after it resumed
    (with nothing saved since) does not ask vLLM to wait for them."""
    tokens = list(range(1100))
    side = _side(rt, {"r": list(range(10))})
    try:
        request = FakeRequest("r", tokens)
        side.new_request(request)  # type: ignore[arg-type]
        assert side.build_meta(FakeSchedulerOutput({"r": 600})).saves  # type: ignore[arg-type]
        request.num_computed_tokens = 0
        side.build_meta(FakeSchedulerOutput({}, preempted_req_ids={"r"}))  # type: ignore[arg-type]
        assert side.finished(request) is False  # type: ignore[arg-type]
    finally:
        side.close()


def _save_plan(side: SchedulerSide, request: FakeRequest, n_tokens: int) -> Any:
    """The save plan of a step that computes `request`'s first `n_tokens` from scratch."""
    side.new_request(request)  # type: ignore[arg-type]
    (save,) = side.build_meta(FakeSchedulerOutput({request.request_id: n_tokens})).saves  # type: ignore[arg-type]
    return save


def test_after_a_cache_reset_no_block_cached_before_is_found_and_new_ones_are(
    rt: process_store.ProcessStore,
) -> None:
    """The weights may have changed: blocks from before are never loaded again, whether this
    side saw them saved or another replica saved them; blocks saved after the reset are."""
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 4)
    side = _side(rt, {"after": list(range(10))})
    waiting = FakeRequest("waiting", tokens)
    try:
        side.new_request(waiting)  # type: ignore[arg-type]
        assert _answer(side, waiting, 0) == (1024, True)  # found, not yet scheduled
        side.reset()
        assert _answer(side, waiting, 0) == (0, False)  # looked up afresh: nothing
        assert _answer(side, FakeRequest("new", tokens), 0) == (0, False)

        save = _save_plan(side, FakeRequest("after", tokens), 1100)
        assert save.parents[0] != root_hash()  # a chain of its own...
        assert set(save.hashes).isdisjoint(block_hashes(tokens, BLOCK))
        parent = save.parents[0]
        for h in save.hashes:  # ...which the next request finds, once saved
            rt.store.save(
                h, BlockMeta(num_tokens=BLOCK, dtype="uint8", shape=(8,), parent=parent), bytes(8)
            )
            parent = h
        assert _answer(side, FakeRequest("later", tokens), 0) == (1024, True)
    finally:
        side.close()


def test_every_reset_starts_a_chain_no_other_replica_or_reset_shares(
    rt: process_store.ProcessStore,
) -> None:
    """A counter would not do: two replicas reset as often, with different weights, would
    share blocks."""
    tokens = list(range(600))
    sides = [_side(rt, {"r": list(range(10))}) for _ in range(2)]
    try:
        roots = set()
        for side in sides:
            for _ in range(2):
                side.reset()
                roots.add(_save_plan(side, FakeRequest("r", tokens), 600).parents[0])
                side.finished(FakeRequest("r", tokens))  # type: ignore[arg-type]
        assert len(roots) == 4
    finally:
        for side in sides:
            side.close()


def test_a_request_scheduled_before_a_reset_neither_loads_nor_saves_again(
    rt: process_store.ProcessStore,
) -> None:
    tokens = list(range(1100))
    side = _side(rt, {"r": list(range(10))}, counters=(counters := ConnectorCounters()))
    try:
        request = FakeRequest("r", tokens)
        _save_plan(side, request, 300)
        side.reset()
        request.num_computed_tokens = 300
        assert side.build_meta(FakeSchedulerOutput({"r": 700})).saves == []  # type: ignore[arg-type]
        request.num_computed_tokens = 0  # preempted, as vLLM's reset does to running requests
        assert side.matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
        assert side.finished(request) is True  # type: ignore[arg-type]  # (its earlier save)
        assert counters.totals()["cache_resets"] == 1
    finally:
        side.close()


def test_the_blocks_a_step_computed_after_a_failed_synchronous_load_are_stale_too(
    rt: process_store.ProcessStore,
) -> None:
    """X loads its first 2 kvtier blocks (engine blocks 10-13) and computes the rest in the
    same step; Y takes X's first blocks from vLLM's prefix cache and computes its own. If
    engine block 12 fails to load, what both computed after it is stale (their attention read
    it); what came before it, and Z's blocks, are not."""
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 2)
    x_ids, y_ids, z_ids = list(range(10, 19)), [10, 11, 12, 13, 30, 31], [40, 41]
    side = _side(rt, {"x": x_ids, "y": y_ids, "z": z_ids}, load_async=False)
    try:
        x = FakeRequest("x", tokens)
        side.new_request(x)  # type: ignore[arg-type]
        assert _answer(side, x, 0) == (512, False)
        side.after_alloc(x, FakeBlocks(x_ids), 512)  # type: ignore[arg-type]
        step = FakeSchedulerOutput({"x": 588, "y": 300, "z": 200})
        (load,) = side.build_meta(step).loads  # type: ignore[arg-type]
        assert load.engine_block_ids == (10, 11, 12, 13)
        assert side.computed_from({12}) == {12, 13, 14, 15, 16, 17, 18, 30, 31}
        assert side.computed_from({40}) == {40}  # (not a loaded block: nothing follows)
    finally:
        side.close()


def _loader_and_sharer(
    rt: process_store.ProcessStore, batches_in_flight: int = 1
) -> tuple[SchedulerSide, FakeRequest, FakeRequest]:
    """A side with synchronous loads where `loader` (engine blocks 0-16) is planned to load its
    first 4 stored kvtier blocks (engine blocks 0-7), and `sharer`, tracked but not yet
    scheduled, holds engine blocks 0-7 too, then 20-29."""
    tokens = list(range(2100))
    _store_blocks(rt, tokens, 4)
    ids = {"loader": list(range(17)), "sharer": [*range(8), *range(20, 30)]}
    side = _side(rt, ids, load_async=False, batches_in_flight=batches_in_flight)
    loader, sharer = FakeRequest("loader", tokens), FakeRequest("sharer", tokens)
    side.new_request(loader)  # type: ignore[arg-type]
    side.new_request(sharer)  # type: ignore[arg-type]
    assert _answer(side, loader, 0) == (1024, False)
    side.after_alloc(loader, FakeBlocks(ids["loader"]), 1024)  # type: ignore[arg-type]
    return side, loader, sharer


def test_a_request_computing_on_from_a_shared_block_that_failed_to_load_saves_nothing_more(
    rt: process_store.ProcessStore,
) -> None:
    """Async scheduling (two steps in flight): A's load of engine blocks 0-7 fails at block 4
    in step N; B, scheduled in step N+1 before that is known, took blocks 0-7 from vLLM's
    prefix cache. vLLM takes A back to block 4 but not B, which computes on from the stale
    block: none of B's later blocks may be saved (its step N+1 save names the loaded blocks
    for the worker to bar), while A saves again once it recomputes."""
    side, a, b = _loader_and_sharer(rt, batches_in_flight=2)
    try:
        (load,) = side.build_meta(FakeSchedulerOutput({"loader": 76})).loads  # type: ignore[arg-type]
        assert load.engine_block_ids == tuple(range(8))  # step N
        b.num_computed_tokens = 1024  # step N+1: B's first 8 blocks from vLLM's prefix cache
        (save,) = side.build_meta(FakeSchedulerOutput({"sharer": 512})).saves  # type: ignore[arg-type]
        assert save.loaded_before == frozenset(range(8))

        assert 4 in side.computed_from({4})  # step N's output: block 4 failed
        a.num_computed_tokens, b.num_computed_tokens = 512, 1536  # vLLM took A back, not B
        saves = side.build_meta(FakeSchedulerOutput({"loader": 600, "sharer": 512})).saves  # type: ignore[arg-type]
        assert [s.req_id for s in saves] == ["loader"]
        assert saves[0].loaded_before == frozenset()  # (the window has passed: B would save)
    finally:
        side.close()


def test_a_failed_block_id_taints_only_the_chains_of_the_steps_in_flight(
    rt: process_store.ProcessStore,
) -> None:
    """Q held engine block 4 after a load one step earlier and finished; vLLM reused block 4
    for A's load, which failed. Only A's chain is stale: Q's blocks, cached and valid, stay."""
    tokens = list(range(1100))
    _store_blocks(rt, tokens, 2)
    q_ids, a_ids = [50, 51, 4, 5, 6, 7], [4, 60, 61, 62, 63]
    side = _side(rt, {"q": q_ids, "a": a_ids}, load_async=False)
    try:
        for name, ids, step in (("q", q_ids, {"q": 588}), ("a", a_ids, {"a": 588})):
            request = FakeRequest(name, tokens)
            side.new_request(request)  # type: ignore[arg-type]
            assert _answer(side, request, 0) == (512, False)
            side.after_alloc(request, FakeBlocks(ids), 512)  # type: ignore[arg-type]
            side.build_meta(FakeSchedulerOutput(step))  # type: ignore[arg-type]
        assert side.computed_from({4}) == {4, 60, 61, 62, 63}
    finally:
        side.close()


def test_a_request_sharing_a_failed_block_in_the_failing_step_saves_once_recomputed(
    rt: process_store.ProcessStore,
) -> None:
    """Y took X's loading blocks from vLLM's prefix cache in the same step, so vLLM takes Y
    back to those blocks (X recomputes the failed one in the next step, beside Y): Y's blocks
    computed then are good, and saved."""
    side, x, y = _loader_and_sharer(rt)
    try:
        y.num_computed_tokens = 1024  # from vLLM's prefix cache, as X's load writes them
        side.build_meta(FakeSchedulerOutput({"loader": 76, "sharer": 512}))  # type: ignore[arg-type]
        assert side.computed_from({4}) >= {4, 20, 21, 22, 23}
        x.num_computed_tokens, y.num_computed_tokens = 512, 1024  # vLLM takes both back
        saves = side.build_meta(FakeSchedulerOutput({"loader": 600, "sharer": 512})).saves  # type: ignore[arg-type]
        assert sorted(s.req_id for s in saves) == ["loader", "sharer"]
    finally:
        side.close()
