"""The kvtier connector inside real vLLM servers: hits from L1 and from a shared L2 give exactly
the greedy tokens of a server without the connector, and faults only cost a recompute.

"Exactly" means: the same tokens vLLM itself produces when the same leading tokens come from
its own prefix cache, computed by the same request. (Greedy decoding is sensitive to how a
prompt's prefill was split: vLLM alone, with 1,024 of a 1,200-token prompt cached, can pick a
different token than with nothing cached. And CPU matrix kernels are not batch-invariant on
every CPU: on an AVX-512 EPYC, a block's KV computed inside a 1,100-token prefill differs in its
last bits from the same block computed inside a 1,024-token one, enough to flip a later greedy
token. So each expectation is computed by a plain vLLM whose prefix cache was primed by the
request that computed the blocks the connector serves: the whole prompt, or, for a partial
hit, exactly the served prefix.)

Engines (each a real `vllm serve` on the embedded model, one pinned thread):
- `reference`: no connector; computes every expected output once, then stops;
- `replica_a`, `replica_b`: the connector with a tiny L0 (40 x 128 tokens) and one shared L2
  directory; `replica_b` never sees a prompt before the L2 tests send it there;
- one connector engine with an unusable L2 path, one on a JuiceFS mount, one on a Valkey
  cluster (their own tests);
- two offline engines (`BatchEngine`) for prompts that must share a scheduler step.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from valkey.cluster import ValkeyCluster

from kvtier.core.codec import HEADER_BYTES, decode_header
from kvtier.core.events import EventKind
from kvtier.core.keys import Namespace, block_hashes, extra_key
from kvtier.core.tiers.base import Tier
from kvtier.core.tiers.usage import CONTROL_DIR
from kvtier.net.kv_events import EventSubscriber
from kvtier.net.ports import free_port
from kvtier.tools.bench.corpus import Corpus
from kvtier.tools.bench.tiers import prompt_ids
from kvtier.tools.l2ops.juicefs import JuiceFSMount
from kvtier.tools.l2ops.valkey_cluster import valkey_cluster
from kvtier.tools.vllm_server import ServerProcess
from tests.helpers.engines import (
    BatchEngine,
    complete,
    kv_transfer_config,
    metric,
    metric_in,
    reset_l0,
    start,
)

pytestmark = pytest.mark.engine

BLOCK = 128
"""vLLM's CPU block size, which the connector takes as its own by default."""
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
LOADED = "kvtier_connector_loaded_blocks_total"
HIT_TOKENS = "kvtier_connector_hit_tokens_total"
SNAPSHOTS = "kvtier_connector_event_snapshots_total"
LAYERED = "kvtier_connector_layered_copy_seconds_total"
FAILED = "kvtier_connector_load_failed_blocks_total"
L1, L2 = {"tier": "l1"}, {"tier": "l2"}

LENGTHS = {
    "l1": 1100,
    "l2": 2100,
    "corrupt": 1400,
    "missing": 1400,
    "race": 1300,
    "salted": 1200,
    "no_l2": 900,
    "events": 1000,
    "juicefs": 1700,
    "valkey_cluster": 1500,  # (add new ones last: each prompt's text depends on its position)
}


@pytest.fixture(scope="module")
def prompts(corpus: Corpus) -> dict[str, list[int]]:
    """Token ids of each test's prompt: real text, a distinct prefix per test."""
    return {
        name: prompt_ids(corpus, n, seed=101 + i) for i, (name, n) in enumerate(LENGTHS.items())
    }


@pytest.fixture(scope="module")
def evictors(corpus: Corpus) -> list[list[int]]:
    """Three prompts of 15 engine blocks each: together they overflow the 40-block L0."""
    return [prompt_ids(corpus, 1900, seed=200 + i) for i in range(3)]


def _usable(tokens: list[int] | int) -> int:
    """Tokens a kvtier hit covers: full blocks, never including the last token."""
    n = tokens if isinstance(tokens, int) else len(tokens)
    return (n - 1) // BLOCK * BLOCK


HITS = {name: [0, _usable(n)] for name, n in LENGTHS.items()}
HITS["corrupt"] = HITS["missing"] = [0, 2 * BLOCK]  # blocks 0 and 1 load, block 2 fails
"""Leading tokens served from a cache in each test's requests (0: computed cold)."""


@pytest.fixture(scope="module")
def expected(
    tmp_path_factory: pytest.TempPathFactory, prompts: dict[str, list[int]], model_dir: str
) -> dict[tuple[str, int], list[int]]:
    """(prompt, cached prefix) -> greedy tokens of a server without the connector."""
    logs = tmp_path_factory.mktemp("logs-reference")
    out: dict[tuple[str, int], list[int]] = {}
    with start(model_dir, logs, "reference") as server:
        for name, hits in HITS.items():
            tokens = prompts[name]
            for hit in hits:
                reset_l0(server)
                if hit:  # L0 then holds exactly `hit` tokens (never the prompt's last one)
                    primer = tokens if hit == _usable(tokens) else tokens[:hit]
                    complete(server, primer, max_tokens=1)
                out[name, hit] = complete(server, tokens)
    return out


@pytest.fixture(scope="module")
def l2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shared-l2")
    return path


@pytest.fixture(scope="module")
def events_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


CO_LOCATED = "inherit"
"""Both replicas share this machine's cores: each one's saver stays on its own engine's core,
never on the other's, where it would starve (docs/connector.md)."""


@pytest.fixture(scope="module")
def replica_a(
    expected: dict[tuple[str, int], list[int]],
    l2_dir: Path,
    events_endpoint: str,
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: str,
) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("logs-a")
    with start(
        model_dir,
        logs,
        "replica-a",
        tiny_cache=True,
        connector=kv_transfer_config(
            l2_path=str(l2_dir),
            l1_bytes=1 << 30,
            events_endpoint=events_endpoint,
            replica_id="replica-a",
            background_cpus=CO_LOCATED,
            load_layerwise=True,  # (off by default where the connector has no core of its own)
        ),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def replica_b(
    replica_a: ServerProcess,
    l2_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: str,
) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("logs-b")
    with start(
        model_dir,
        logs,
        "replica-b",
        tiny_cache=True,
        cpu_ids="1",
        connector=kv_transfer_config(
            l2_path=str(l2_dir),
            l1_bytes=1 << 30,
            background_cpus=CO_LOCATED,
            load_layerwise=True,
        ),
    ) as server:
        yield server


def _block_files(l2_dir: Path, tokens: list[int], salt: str | None = None) -> list[Path]:
    """The L2 file of each full kvtier block of `tokens`, in chain order (may not exist)."""
    namespaces = [p for p in l2_dir.iterdir() if p.is_dir() and p.name != CONTROL_DIR]
    assert len(namespaces) == 1, namespaces
    ns = namespaces[0]
    hashes = block_hashes(tokens, BLOCK, extra_key(cache_salt=salt) if salt else b"")
    return [ns / h.hex()[0:2] / h.hex()[2:4] / f"{h.hex()}.kvt" for h in hashes]


WRITE_PATH_METRICS = (
    "kvtier_connector_saved_blocks_total",
    "kvtier_connector_save_skipped_blocks_total",
    "kvtier_connector_save_rejected_blocks_total",
    "kvtier_connector_save_failed_blocks_total",
    "kvtier_connector_save_dropped_blocks_total",
    "kvtier_connector_l2_dropped_writes_total",
    "kvtier_connector_l2_queue_depth",
    "kvtier_connector_l2_unavailable_total",
    "kvtier_connector_tier_errors_total",
)


def _wait_for_files(
    paths: list[Path], servers: tuple[ServerProcess, ...] = (), timeout_s: float = 300.0
) -> None:
    """Wait until every path is a file; on timeout, fail with the missing ones and the write
    path's counters of `servers` (why a block never reached L2). The bound is generous: these
    tests are about what gets written, not how fast (before `CO_LOCATED`, saves after the race
    below took minutes)."""
    deadline = time.monotonic() + timeout_s
    while not all(p.is_file() for p in paths):
        if time.monotonic() > deadline:
            pages = {s.url: httpx.get(s.url + "/metrics", timeout=60).text for s in servers}
            counters = {
                url: {m: metric_in(page, m) for m in WRITE_PATH_METRICS}
                for url, page in pages.items()
            }
            missing = [p.name for p in paths if not p.is_file()]
            pytest.fail(f"{len(missing)} of {len(paths)} blocks not in L2: {missing}; {counters}")
        time.sleep(0.2)


def test_l1_hit_after_l0_eviction_gives_identical_tokens(
    replica_a: ServerProcess,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
    evictors: list[list[int]],
) -> None:
    tokens = prompts["l1"]
    assert complete(replica_a, tokens) == expected["l1", 0]
    for evictor in evictors:  # push the prompt's blocks out of the 40-block L0
        complete(replica_a, evictor, max_tokens=1)
    local_before = metric(replica_a, LOCAL_HITS)
    external_before = metric(replica_a, EXTERNAL_HITS)
    l1_before = metric(replica_a, LOADED, L1)
    l1_tokens_before = metric(replica_a, HIT_TOKENS, L1)
    layered_before = metric(replica_a, LAYERED)
    failed_before = metric(replica_a, FAILED)

    assert complete(replica_a, tokens) == expected["l1", HITS["l1"][1]]
    # copied beside the forward pass, which waited for every layer (else: recomputed)
    assert metric(replica_a, LAYERED) > layered_before
    assert metric(replica_a, FAILED) == failed_before

    assert metric(replica_a, LOCAL_HITS) == local_before  # L0 really lost it
    assert metric(replica_a, EXTERNAL_HITS) - external_before == _usable(tokens)
    assert metric(replica_a, LOADED, L1) - l1_before == _usable(tokens) // BLOCK
    assert metric(replica_a, HIT_TOKENS, L1) - l1_tokens_before == _usable(tokens)


def test_l2_hit_on_a_replica_that_never_saw_the_prompt_gives_identical_tokens(
    replica_a: ServerProcess,
    replica_b: ServerProcess,
    l2_dir: Path,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
) -> None:
    tokens = prompts["l2"]
    assert complete(replica_a, tokens) == expected["l2", 0]
    _wait_for_files(_block_files(l2_dir, tokens))
    external_before = metric(replica_b, EXTERNAL_HITS)
    l2_tokens_before = metric(replica_b, HIT_TOKENS, L2)
    layered_before = metric(replica_b, LAYERED)
    failed_before = metric(replica_b, FAILED)

    assert complete(replica_b, tokens) == expected["l2", HITS["l2"][1]]
    # read layer by layer beside the forward pass, and every block verified
    assert metric(replica_b, LAYERED) > layered_before
    assert metric(replica_b, FAILED) == failed_before

    external = metric(replica_b, EXTERNAL_HITS) - external_before
    full_engine_block_tokens = len(tokens) // 128 * 128
    assert external >= 0.9 * full_engine_block_tokens
    assert metric(replica_b, LOADED, L2) >= _usable(tokens) // BLOCK
    assert metric(replica_b, HIT_TOKENS, L2) - l2_tokens_before == _usable(tokens)


@pytest.mark.juicefs
def test_an_l2_hit_through_another_juicefs_mount_is_read_beside_the_forward(
    replica_a: ServerProcess,
    l2_dir: Path,
    two_mounts: tuple[JuiceFSMount, JuiceFSMount],
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
    tmp_path: Path,
    model_dir: str,
) -> None:
    """Replica A's blocks land in a JuiceFS volume through one mount (copied file by file);
    a replica on the other mount, with the juicefs profile, reads them layer by layer beside
    the forward pass, its headers with the first layer: the tokens of an L2 hit."""
    tokens = prompts["juicefs"]
    assert complete(replica_a, tokens) == expected["juicefs", 0]
    files = _block_files(l2_dir, tokens)
    _wait_for_files(files)
    writer, reader = two_mounts
    for f in files:
        copied = Path(writer.path) / f.relative_to(l2_dir)
        copied.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, copied)
    _wait_for_files([Path(reader.path) / f.relative_to(l2_dir) for f in files], timeout_s=30)
    with start(
        model_dir,
        tmp_path,
        "replica-juicefs",
        tiny_cache=True,
        cpu_ids="1",
        connector=kv_transfer_config(
            l2_path=reader.path,
            l2_profile="juicefs",
            l1_bytes=1 << 30,
            background_cpus=CO_LOCATED,
            load_layerwise=True,
        ),
    ) as server:
        assert complete(server, tokens) == expected["juicefs", HITS["juicefs"][1]]
        assert metric(server, LOADED, L2) == _usable(tokens) // BLOCK
        # no L1 to copy from on a fresh replica: only piece reads are layered
        assert metric(server, LAYERED) > 0
        assert metric(server, FAILED) == 0


@pytest.mark.valkey
def test_an_l2_hit_from_a_valkey_cluster_gives_identical_tokens(
    replica_a: ServerProcess,
    l2_dir: Path,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
    tmp_path: Path,
    model_dir: str,
) -> None:
    """Replica A's blocks, stored in a three-shard Valkey cluster (a Valkey L2 value holds the
    bytes of the block's file), are loaded by a replica whose `l2_url` names one node: the
    tokens of an L2 hit, its blocks read from every shard."""
    tokens = prompts["valkey_cluster"]
    assert complete(replica_a, tokens) == expected["valkey_cluster", 0]
    files = _block_files(l2_dir, tokens)
    _wait_for_files(files)
    namespace = files[0].parents[2].name
    with valkey_cluster(3) as nodes:
        with ValkeyCluster.from_url(nodes[0].url) as client:
            for f in files:
                client.set(f"{namespace}:{f.name.removesuffix('.kvt')}", f.read_bytes())
            assert all(client.dbsize(target_nodes=node) for node in client.get_primaries())
        with start(
            model_dir,
            tmp_path,
            "replica-valkey-cluster",
            tiny_cache=True,
            cpu_ids="1",
            connector=kv_transfer_config(
                l2_url=nodes[1].url, l1_bytes=1 << 30, background_cpus=CO_LOCATED
            ),
        ) as server:
            hit = HITS["valkey_cluster"][1]
            assert complete(server, tokens) == expected["valkey_cluster", hit]
            assert metric(server, LOADED, L2) == _usable(tokens) // BLOCK
            assert metric(server, FAILED) == 0


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_corrupt_or_missing_l2_block_fails_its_load_and_is_recomputed(
    damage: str,
    replica_a: ServerProcess,
    replica_b: ServerProcess,
    l2_dir: Path,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
) -> None:
    """Block 2 of a chain is corrupt (the bad file is removed), or missing while the blocks
    after it exist (the lookup's bisection takes it for held): its load fails, blocks 0 and 1
    load, vLLM recomputes from block 2, and the tokens are those of a 2-block hit."""
    tokens = prompts[damage]
    assert complete(replica_a, tokens) == expected[damage, 0]
    files = _block_files(l2_dir, tokens)
    _wait_for_files(files)
    bad = files[2]
    good = bad.read_bytes()
    data = bytearray(good)
    if damage == "corrupt":
        data[-100:] = bytes(100)  # zero the payload's tail: the checksum no longer matches
        bad.write_bytes(bytes(data))
    else:
        bad.unlink()
    failed_before = metric(replica_b, FAILED)
    external_before = metric(replica_b, EXTERNAL_HITS)

    assert complete(replica_b, tokens) == expected[damage, HITS[damage][1]]

    assert metric(replica_b, FAILED) - failed_before >= 1
    assert metric(replica_b, LOADED, L2) >= 2  # the blocks before it
    assert metric(replica_b, EXTERNAL_HITS) > external_before
    # the bad file was removed (or was gone), and the recompute saved a good one in its place:
    # the block's KV as computed after a 2-block hit, within rounding of replica A's (the save
    # of the step whose load failed would copy engine memory that still held stale KV)
    _wait_for_files([bad])
    if damage == "corrupt":
        assert bad.read_bytes() != bytes(data)
    original, resaved = (_kv_values(raw) for raw in (good, bad.read_bytes()))
    assert (resaved - original).abs().mean() < 0.05 * original.abs().mean()


def test_blocks_computed_in_the_step_of_a_failed_load_from_its_blocks_are_never_saved(
    model_dir: str, corpus: Corpus, tmp_path: Path
) -> None:
    """Two prompts in one scheduler step: X loads its prefix from L2, where block 2 is corrupt;
    Y shares X's first 5 blocks, takes them from vLLM's prefix cache as X's load writes them,
    and computes its own blocks from them, block 2's stale KV included. The load fails; vLLM
    recomputes both, and Y's blocks reach L2 only as computed from good KV: within rounding of
    the same blocks computed after a clean prefix. (A save of the failed step would put blocks
    computed from the stale block in L2, where the first write of a block stays.)"""
    x = prompt_ids(corpus, 1400, seed=301)
    y = x[: 5 * BLOCK] + prompt_ids(corpus, 700, seed=302)
    clean, y_files = _clean_then_corrupt(model_dir, tmp_path, x, y, shared=5)
    _assert_faulty_run_resaves(model_dir, tmp_path, clean, y_files, batches=[[x, y]])


def test_a_block_that_failed_to_load_leaves_the_prefix_cache_with_its_aborted_request(
    model_dir: str, corpus: Corpus, tmp_path: Path
) -> None:
    """X loads its prefix from L2 with block 2 corrupt, and is aborted right after that step,
    before it recomputes the block. vLLM (`recompute` policy) keeps the blocks it cached for
    the load, the failed one included; the connector evicts the failed one from vLLM's prefix
    cache. Y, extending X, then takes only the good blocks before it from L0, and its own
    blocks reach L2 computed from good KV, within rounding of a clean run's."""
    x = prompt_ids(corpus, 1400, seed=303)
    y = x + prompt_ids(corpus, 700, seed=304)
    clean, y_files = _clean_then_corrupt(model_dir, tmp_path, x, y, shared=10)
    _assert_faulty_run_resaves(model_dir, tmp_path, clean, y_files, batches=[[y]], aborted=x)


def test_blocks_computed_in_the_step_of_a_failed_load_leave_the_prefix_cache_too(
    model_dir: str, corpus: Corpus, tmp_path: Path
) -> None:
    """X loads 10 blocks from L2, the last one corrupt, computes 6 more in the same step from
    its stale KV, and is aborted before it recomputes. vLLM cached all 16 when it scheduled
    them; the connector evicts the failed block and the 6 computed from it. W then computes
    block 9 afresh, so vLLM's prefix cache holds the chain up to it again; V, extending X,
    must not take X's 6 stale blocks after it: its own blocks reach L2 within rounding of a
    clean run's. (Without the eviction V takes them from L0, never saves them, and computes
    the rest from them.)"""
    p = prompt_ids(corpus, 10 * BLOCK + 50, seed=306)
    v = p[: 10 * BLOCK] + prompt_ids(corpus, 6 * BLOCK + 700, seed=307)
    x = v[: 16 * BLOCK + 50]
    w = p[: 10 * BLOCK] + prompt_ids(corpus, 300, seed=308)
    clean, v_files = _clean_then_corrupt(model_dir, tmp_path, p, v, shared=10, corrupt=9)
    _assert_faulty_run_resaves(model_dir, tmp_path, clean, v_files, batches=[[w], [v]], aborted=x)


def test_after_new_weights_and_a_cache_reset_no_kv_of_the_old_weights_is_served(
    model_dir: str, corpus: Corpus, tmp_path: Path
) -> None:
    """An RLHF weight sync: new weights in place, then vLLM's reset of its prefix cache and the
    connector's. The prompt's blocks of the old weights are still in L1 and L2; the next
    request must compute it afresh with the new weights (the greedy tokens of a salted request,
    which no cache serves), and its blocks are saved again, under a chain of their own: an L1
    hit would save none, and the salted request's blocks would be the only new ones."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    prompt = prompt_ids(corpus, 1100, seed=305)
    salt = "never-cached"
    with BatchEngine(model_dir, l2, tmp_path / "new-weights.log") as engine:
        (old,) = engine.generate([prompt])
        _wait_for_files(_block_files(l2, prompt))
        engine.new_weights(scale=1.5)
        (served,) = engine.generate([prompt])
        (fresh,) = engine.generate([{"prompt_token_ids": prompt, "cache_salt": salt}])
        assert fresh != old  # (the new weights change the output)
        assert served == fresh
        # the old weights' blocks, and the new weights' of both requests (chains of their own)
        deadline = time.monotonic() + 300
        n = len(_block_files(l2, prompt))
        while len(list(l2.glob("*/*/*/*.kvt"))) < 3 * n and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(l2.glob("*/*/*/*.kvt"))) == 3 * n


def _clean_then_corrupt(
    model_dir: str, work: Path, x: list[int], y: list[int], shared: int, corrupt: int = 2
) -> tuple[list[bytes], list[Path]]:
    """A clean run on the L2 `work/l2`: x, then y, whose first `shared` blocks are x's (L0
    hits). Returns y's own blocks as that run stored them, and their files, which it removes
    for a faulty run to write again; x's block `corrupt` is then corrupted (its load fails)."""
    l2 = work / "l2"
    l2.mkdir()
    with BatchEngine(model_dir, l2, work / "clean.log") as engine:
        engine.generate([x])
        engine.generate([y])
        x_files, y_files = _block_files(l2, x), _block_files(l2, y)[shared:]
        _wait_for_files(x_files + y_files)
    clean = [f.read_bytes() for f in y_files]
    for f in y_files:
        f.unlink()
    data = bytearray(x_files[corrupt].read_bytes())
    data[-100:] = bytes(100)  # the checksum no longer matches
    x_files[corrupt].write_bytes(bytes(data))
    return clean, y_files


def _assert_faulty_run_resaves(
    model_dir: str,
    work: Path,
    clean: list[bytes],
    files: list[Path],
    batches: list[list[list[int]]],
    aborted: list[int] | None = None,
) -> None:
    """The faulty run on `work/l2` (after `_clean_then_corrupt`): `aborted` for one engine
    step, then each of `batches`; the block `files` it writes again must each hold KV within
    rounding of the `clean` run's."""
    with BatchEngine(model_dir, work / "l2", work / "faulty.log") as engine:
        if aborted is not None:
            engine.abort_after_one_step(aborted)
        for batch in batches:
            engine.generate(list(batch))
        _wait_for_files(files)
    for good, resaved in zip(clean, files, strict=True):
        expected, stored = _kv_values(good), _kv_values(resaved.read_bytes())
        assert (stored - expected).abs().mean() < 0.05 * expected.abs().mean(), resaved.name


def _kv_values(block_file: bytes) -> torch.Tensor:
    """A stored block's KV payload as floats, in the dtype its header names."""
    namespace = Namespace(block_file[16:48].rstrip(b"\0").decode("ascii"))
    header = decode_header(block_file[:HEADER_BYTES], namespace=namespace)
    payload = bytearray(block_file[HEADER_BYTES:])
    return torch.frombuffer(payload, dtype=getattr(torch, header.meta.dtype)).float()


def test_two_replicas_computing_one_prefix_together_write_each_block_once(
    replica_a: ServerProcess,
    replica_b: ServerProcess,
    l2_dir: Path,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
    evictors: list[list[int]],
) -> None:
    tokens = prompts["race"]
    results: dict[str, list[int]] = {}

    def run(name: str, server: ServerProcess) -> None:
        results[name] = complete(server, tokens)

    threads = [
        threading.Thread(target=run, args=(n, s)) for n, s in (("a", replica_a), ("b", replica_b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)

    assert results == {"a": expected["race", 0], "b": expected["race", 0]}
    files = _block_files(l2_dir, tokens)
    _wait_for_files(files, (replica_a, replica_b))

    def siblings() -> list[list[str]]:
        return [
            sorted(p.name for p in f.parent.iterdir() if p.name.startswith(f.stem)) for f in files
        ]

    # One published file each, no temp file left behind once the slower writer, whose link()
    # lost, has removed its own (a bounded wait: it may still be writing it).
    deadline = time.monotonic() + 30
    while siblings() != [[f.name] for f in files] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert siblings() == [[f.name] for f in files]
    # and the block a third party reads back is intact: replica A reloads it after eviction
    for evictor in evictors:
        complete(replica_a, evictor, max_tokens=1)
    assert complete(replica_a, tokens) == expected["race", HITS["race"][1]]


def test_cache_salt_splits_the_cache(
    replica_a: ServerProcess,
    replica_b: ServerProcess,
    l2_dir: Path,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
) -> None:
    tokens = prompts["salted"]
    assert complete(replica_a, tokens, cache_salt="tenant-a") == expected["salted", 0]
    _wait_for_files(_block_files(l2_dir, tokens, salt="tenant-a"))
    assert not any(p.exists() for p in _block_files(l2_dir, tokens))
    external_before = metric(replica_b, EXTERNAL_HITS)

    assert complete(replica_b, tokens, cache_salt="tenant-b") == expected["salted", 0]
    assert metric(replica_b, EXTERNAL_HITS) == external_before  # another tenant: no hit

    reset_l0(replica_b)
    hit = expected["salted", HITS["salted"][1]]
    assert complete(replica_b, tokens, cache_salt="tenant-a") == hit
    assert metric(replica_b, EXTERNAL_HITS) > external_before  # the same tenant: L2 hit


def test_unusable_l2_path_runs_l1_only_and_is_counted(
    tmp_path: Path,
    expected: dict[tuple[str, int], list[int]],
    prompts: dict[str, list[int]],
    model_dir: str,
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("L2 cannot live under a regular file")
    with start(
        model_dir,
        tmp_path,
        "no-l2",
        connector=kv_transfer_config(l2_path=str(not_a_dir / "l2"), l1_bytes=1 << 30),
    ) as server:
        tokens = prompts["no_l2"]
        assert complete(server, tokens) == expected["no_l2", 0]
        reset_l0(server)
        assert complete(server, tokens) == expected["no_l2", HITS["no_l2"][1]]
        assert metric(server, LOADED, L1) == _usable(tokens) // BLOCK
        assert metric(server, "kvtier_connector_l2_unavailable_total") == 1
    assert not (not_a_dir / "l2").exists()


def test_saved_blocks_are_announced_with_the_routers_engine_block_hashes(
    replica_a: ServerProcess,
    events_endpoint: str,
    prompts: dict[str, list[int]],
) -> None:
    tokens = prompts["events"]
    engine_hashes = block_hashes(tokens, 128)[: _usable(tokens) // 128]
    with EventSubscriber([events_endpoint]) as sub:
        time.sleep(1.0)  # let the subscription reach the publisher
        complete(replica_a, tokens, max_tokens=1)
        stored: dict[Tier, list[bytes]] = {Tier.L1: [], Tier.L2: []}
        deadline = time.monotonic() + 60
        while (
            len(stored[Tier.L1]) < len(engine_hashes) or len(stored[Tier.L2]) < len(engine_hashes)
        ) and time.monotonic() < deadline:
            for event in sub.drain(timeout_s=0.5):
                assert event.replica == "replica-a"
                if event.kind == EventKind.STORED and event.tier in stored:
                    stored[event.tier] += [h for h in event.hashes if h in engine_hashes]
    assert stored[Tier.L1] == engine_hashes
    assert sorted(stored[Tier.L2]) == sorted(engine_hashes)  # L2 writes finish in any order

    snapshots_before = metric(replica_a, SNAPSHOTS)
    with EventSubscriber([events_endpoint]) as late:  # a router started after the stores
        held: dict[Tier, set[bytes]] = {Tier.L1: set(), Tier.L2: set()}
        deadline = time.monotonic() + 30
        while not all(set(engine_hashes) <= h for h in held.values()):
            assert time.monotonic() < deadline, "no snapshot of the held blocks"
            for event in late.drain(timeout_s=0.5):
                if event.kind == EventKind.STORED and event.tier in held:
                    held[event.tier] |= set(event.hashes)
    deadline = time.monotonic() + 60
    while metric(replica_a, SNAPSHOTS) == snapshots_before:  # stats travel with engine steps
        assert time.monotonic() < deadline, "the snapshot was not counted"
        complete(replica_a, tokens[:8], max_tokens=1)
        time.sleep(0.5)
    assert metric(replica_a, "kvtier_connector_events_published_total") > 0
