"""Tenants on real replicas: behind the router, tenant B's prompt identical to tenant A's gets no
cached token from A's (not from vLLM's own cache, not from kvtier's L1 or shared L2), while A's
own repeat does, even on the other replica (through the shared L2); tenants an operator lets
share the namespace do share.

Two vLLM replicas on the embedded model with the kvtier connector (L1 + one shared L2
directory), round robin, so consecutive requests land on different replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.net.ports import free_port
from kvtier.router.settings import RouterSettings
from kvtier.tools.vllm_server import SHARED_MACHINE_WAIT, ServerProcess, ServerSpec, start_server
from tests.helpers.engines import kv_transfer_config
from tests.helpers.router import RouterThread

pytestmark = pytest.mark.engine

KEYS = "alpha sk-alpha\nbravo sk-bravo\ncharlie sk-charlie\npublic sk-public\nsk-shared\n"
PROMPT_BLOCKS = 8
"""Full 128-token blocks of a 1,200-token prompt the L2 must hold before another replica asks."""
SETTLE_S = 1.5
"""An L2 whose block count has not changed for this long has no write under way."""


def l2_blocks(root: Path) -> int:
    return sum(1 for _ in root.rglob("*.kvt"))


def settled_l2(root: Path, at_least: int = 0, timeout_s: float = 60.0) -> int:
    """The L2's block count once it holds `at_least` blocks and has not changed for a while:
    the L2 is written behind the requests, in any order, so a count alone can be reached by an
    earlier prompt's late blocks while the first block of the next one is still missing."""
    deadline = time.monotonic() + timeout_s
    count, since = l2_blocks(root), time.monotonic()
    while count < at_least or time.monotonic() - since < SETTLE_S:
        assert time.monotonic() < deadline, f"L2 holds {count} blocks, still changing"
        time.sleep(0.2)
        now = l2_blocks(root)
        if now != count:
            count, since = now, time.monotonic()
    return count


@pytest.fixture(scope="module")
def replicas(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[str], Path]]:
    tmp = tmp_path_factory.mktemp("tenants")
    l2 = tmp / "l2"
    l2.mkdir()
    servers: list[ServerProcess] = []
    try:
        for i in range(2):
            port = free_port()
            connector = kv_transfer_config(
                l1_bytes=512 * 1024**2, l2_path=str(l2), replica_id=f"http://127.0.0.1:{port}"
            )
            spec = ServerSpec(
                model=model_dir,
                port=port,
                kv_transfer_config=connector,
                max_model_len=4096,
                threads=1,
                cpu_ids=str(i),
                queue_wait=SHARED_MACHINE_WAIT,
                extra_args=["--enable-prompt-tokens-details"],
                log_path=tmp / f"replica{i}.log",
            )
            servers.append(start_server(spec, timeout_s=600))
        yield [s.url for s in servers], l2
    finally:
        for s in servers:
            s.stop()


def test_tenants_never_share_cached_blocks_unless_allowed(
    replicas: tuple[list[str], Path], model_dir: str, corpus, tmp_path: Path
) -> None:
    urls, l2 = replicas
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    config = RouterSettings(
        replicas=urls,
        strategy="roundrobin",
        model_dir=model_dir,
        api_keys_file=str(keys),
        shared_cache_tenants=("public",),
        port=0,
        seed=0,
    )
    prompt = corpus.document(1200, seed=4242)
    other = corpus.document(1200, seed=4343)
    with RouterThread(config) as rt:
        model = Path(model_dir).name

        def cached(key: str, text: str) -> int:
            resp = httpx.post(
                rt.url + "/v1/completions",
                json={"model": model, "prompt": text, "max_tokens": 1, "temperature": 0},
                headers={"Authorization": f"Bearer {key}"},
                timeout=600,
            )
            resp.raise_for_status()
            details = resp.json()["usage"].get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0)

        # round robin: requests alternate between replica 1 and replica 2
        assert cached("sk-alpha", prompt) == 0  # r1 computes it
        settled_l2(l2, PROMPT_BLOCKS)
        assert cached("sk-alpha", prompt) >= 1024  # r2: alpha's own blocks, from the L2
        assert cached("sk-bravo", prompt) == 0  # r1 holds alpha's blocks in L0/L1: not bravo's
        assert cached("sk-charlie", prompt) == 0  # r2 and the L2 too: nothing for charlie
        assert cached("sk-bravo", prompt) >= 1024  # r1: bravo's own, now cached
        # the shared namespace: a keyless key and an allowed tenant share blocks
        before = settled_l2(l2)
        assert cached("sk-shared", other) == 0  # r2
        settled_l2(l2, before + PROMPT_BLOCKS)
        assert cached("sk-public", other) >= 1024  # r1, from the L2
        assert cached("sk-alpha", other) == 0  # r2: alpha stays apart from it
