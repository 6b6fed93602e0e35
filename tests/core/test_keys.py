"""Seedless block hashes and namespaces: identical across processes, split by every input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvtier.core.errors import ConfigError
from kvtier.core.keys import (
    ModelIdentity,
    block_hashes,
    chain_hash,
    extra_key,
    root_hash,
)

TOKENS = list(range(1000, 1000 + 1030))  # 4 full blocks of 256 and a 6-token tail
IDENTITY = ModelIdentity(model="SmolLM2-135M-Instruct", weights_digest="abc")

_PRINT_KEYS = """
import json
from kvtier.core.keys import ModelIdentity, block_hashes, extra_key
tokens = list(range(1000, 2030))
print(json.dumps({
    "plain": [h.hex() for h in block_hashes(tokens, 256)],
    "salted": [h.hex() for h in block_hashes(tokens, 256, extra_key(cache_salt="s"))],
    "namespace": ModelIdentity(model="SmolLM2-135M-Instruct", weights_digest="abc").namespace(),
}))
"""


def keys_in_fresh_process(hashseed: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run(
        [sys.executable, "-c", _PRINT_KEYS],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return json.loads(out)


def test_hashes_and_namespace_are_identical_across_processes_and_hash_seeds() -> None:
    first, second = keys_in_fresh_process("1"), keys_in_fresh_process("4242")
    assert first == second
    assert first["plain"] == [h.hex() for h in block_hashes(TOKENS, 256)]
    assert first["namespace"] == IDENTITY.namespace()


def test_chain_links_each_block_to_its_parent_and_skips_the_tail() -> None:
    hashes = block_hashes(TOKENS, 256)
    assert len(hashes) == 4
    parent = root_hash()
    for i, h in enumerate(hashes):
        assert h == chain_hash(parent, TOKENS[i * 256 : (i + 1) * 256])
        assert len(h) == 16
        parent = h
    assert block_hashes(TOKENS[:255], 256) == []


def test_continuing_a_chain_equals_hashing_it_whole() -> None:
    hashes = block_hashes(TOKENS, 256)
    assert block_hashes(TOKENS[512:], 256, parent=hashes[1]) == hashes[2:]


def test_changing_one_token_changes_that_block_and_all_after_it_only() -> None:
    changed = list(TOKENS)
    changed[600] += 1  # inside block 2
    before, after = block_hashes(TOKENS, 256), block_hashes(changed, 256)
    assert after[:2] == before[:2]
    assert all(a != b for a, b in zip(after[2:], before[2:], strict=True))


def test_same_tokens_at_a_different_position_hash_differently() -> None:
    block = TOKENS[:256]
    first = block_hashes(block * 2, 256)
    assert first[0] != first[1]


@pytest.mark.parametrize(
    "extra",
    [
        extra_key(lora="adapter-a"),
        extra_key(cache_salt="tenant-1"),
        extra_key(mm_hashes=["img0"]),
    ],
)
def test_extra_keys_split_the_chain_from_the_first_block(extra: bytes) -> None:
    plain, split = block_hashes(TOKENS, 256), block_hashes(TOKENS, 256, extra)
    assert not set(plain) & set(split)
    assert block_hashes(TOKENS, 256, extra) == split


def test_extra_keys_are_canonical_and_distinct() -> None:
    assert extra_key() == b""
    keys = {
        extra_key(lora="a"),
        extra_key(lora="b"),
        extra_key(cache_salt="a"),
        extra_key(mm_hashes=["a"]),
        extra_key(mm_hashes=["a", "b"]),
        extra_key(lora="a", cache_salt="a"),
    }
    assert len(keys) == 6
    assert extra_key(cache_salt="x", lora="y") == extra_key(lora="y", cache_salt="x")


def test_namespace_changes_with_each_identity_field() -> None:
    changed = {
        "model": "other",
        "weights_digest": "def",
        "kv_dtype": "float16",
        "kv_layout": "kv,layers,tokens,heads,dim",
        "block_tokens": 128,
        "tp_size": 2,
        "tp_rank": 0,
        "engine": "sglang",
        "format_version": 2,
    }
    assert set(changed) == {f.name for f in dataclasses.fields(ModelIdentity)}
    namespaces = {IDENTITY.namespace()}
    for field, value in changed.items():
        if field == "tp_rank":
            variant = dataclasses.replace(IDENTITY, tp_size=2, tp_rank=1)
        else:
            variant = dataclasses.replace(IDENTITY, **{field: value})  # type: ignore[arg-type]
        namespaces.add(variant.namespace())
    assert len(namespaces) == 1 + len(changed)
    assert (
        ModelIdentity(model="SmolLM2-135M-Instruct", weights_digest="abc").namespace()
        == IDENTITY.namespace()
    )


def test_manifest_names_the_namespace_and_identity() -> None:
    manifest = IDENTITY.manifest()
    assert manifest["namespace"] == IDENTITY.namespace()
    assert manifest["identity"] == dataclasses.asdict(IDENTITY)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"model": ""}, "model"),
        ({"model": "m", "block_tokens": 0}, "block_tokens"),
        ({"model": "m", "tp_size": 2, "tp_rank": 2}, "tp_rank"),
    ],
)
def test_identity_rejects_invalid_fields(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelIdentity(**kwargs)  # type: ignore[arg-type]


def test_block_tokens_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="block_tokens"):
        block_hashes(TOKENS, 0)
