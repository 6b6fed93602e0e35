"""Router API keys: from the environment or a file, several, compared in constant time,
rotated without a restart; tenants get their own cache salt; no key ever leaks."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from pathlib import Path

import pytest

from kvtier.core.errors import ConfigError
from kvtier.router import auth
from kvtier.router.auth import KEYS_ENV, TENANT_SALT_PREFIX, ApiKeys, Denied
from kvtier.router.openai_request import BadRequest
from kvtier.router.tokenizer import Tokenizer
from tests.helpers.aio import run
from tests.helpers.router import completion, fakes, running_router

KEY_A1, KEY_A2, KEY_B, KEY_SHARED = "sk-alpha-one", "sk-alpha-two", "sk-bravo", "sk-common"
KEYS_FILE = f"""# tenant key
alpha {KEY_A1}
alpha {KEY_A2}
bravo {KEY_B}
{KEY_SHARED}
"""


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    """The keys file of tenants alpha (two keys), bravo and a shared-namespace key."""
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    return path


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----- the key set -----


def test_keys_come_from_the_setting_the_environment_and_the_file(keys_file: Path) -> None:
    keys = ApiKeys("sk-flag", str(keys_file), environ={KEYS_ENV: "sk-env1, delta sk-env2"})
    assert len(keys) == 7
    assert keys.authenticate("Bearer sk-flag") is None
    assert keys.authenticate("Bearer sk-env1") is None
    assert keys.authenticate("bearer sk-env2") == "delta"
    assert keys.authenticate(f"Bearer {KEY_A2}") == "alpha"
    assert keys.authenticate(f"Bearer {KEY_SHARED}") is None
    for bad in ("", "Bearer", "Bearer ", "Bearer sk-nope", f"Basic {KEY_B}", KEY_B):
        with pytest.raises(Denied):
            keys.authenticate(bad)


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)  # the module auth compares with
    keys = ApiKeys(None, environ={KEYS_ENV: ",".join(f"k{i}" for i in range(20))})
    for presented in ("k0", "k19", "nope"):
        calls.clear()
        try:
            keys.authenticate(f"Bearer {presented}")
        except Denied:
            pass
        assert len(calls) == 20  # no early exit: the time does not tell which key matched


def test_a_malformed_keys_file_is_a_config_error_that_does_not_echo_it(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"alpha {KEY_A1} extra-field\n")
    with pytest.raises(ConfigError, match="entry 1") as raised:
        ApiKeys(None, str(keys_file), environ={})
    assert KEY_A1 not in str(raised.value)
    with pytest.raises(ConfigError, match="cannot read"):
        ApiKeys(None, str(tmp_path / "missing"), environ={})


def test_keys_rotate_without_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"alpha {KEY_A1}\n")
    keys = ApiKeys(None, str(keys_file), environ={}, clock=lambda: now[0])
    assert keys.authenticate(f"Bearer {KEY_A1}") == "alpha"
    write_atomically(keys_file, f"alpha {KEY_A2}\n")
    now[0] += 1.5
    assert keys.authenticate(f"Bearer {KEY_A2}") == "alpha"
    with pytest.raises(Denied):
        keys.authenticate(f"Bearer {KEY_A1}")
    # a broken file mid-rotation keeps the keys in force, and the log names no key
    write_atomically(keys_file, f"alpha {KEY_B} junk\n")
    now[0] += 1.5
    with caplog.at_level(logging.WARNING):
        assert keys.authenticate(f"Bearer {KEY_A2}") == "alpha"
    assert "previous keys kept" in caplog.text and KEY_B not in caplog.text


def test_tenant_salts_are_disjoint_stable_and_keep_the_clients_own_inside() -> None:
    keys = ApiKeys(None, environ={}, shared_tenants=["public"])
    a, b = keys.cache_salt("alpha", None), keys.cache_salt("bravo", None)
    assert isinstance(a, str) and isinstance(b, str) and a != b
    assert keys.cache_salt("alpha", None) == ApiKeys(None, environ={}).cache_salt("alpha", None)
    assert keys.cache_salt("alpha", "mine") == f"{a}:mine"
    assert keys.cache_salt("bravo", a) != a  # a client cannot name another tenant's salt
    assert keys.cache_salt(None, "x") == "x" and keys.cache_salt("public", None) is None
    keyed = ApiKeys(None, environ={auth.SALT_KEY_ENV: "operator-secret"})
    assert keyed.cache_salt("alpha", None) != a  # the operator's secret changes every salt


# ----- through the router -----


def test_the_router_authenticates_and_salts_each_tenants_requests(
    keys_file: Path, tokenizer: Tokenizer
) -> None:

    async def scenario() -> None:
        async with (
            fakes("ok") as (a,),
            running_router(tokenizer, [a], api_keys_file=str(keys_file)) as rr,
        ):
            url = rr.url + "/v1/completions"
            assert (await rr.client.post(url, json=completion())).status_code == 401
            for key in (KEY_A1, KEY_A2, KEY_B, KEY_SHARED):
                resp = await rr.client.post(url, json=completion(), headers=bearer(key))
                assert resp.status_code == 200
            resp = await rr.client.post(
                url, json=completion(cache_salt="own"), headers=bearer(KEY_B)
            )
            assert resp.status_code == 200
            salts = [body.get("cache_salt") for body in a.received]
            assert salts[0] == salts[1] and salts[0] is not None  # alpha's two keys
            assert salts[2] not in (None, salts[0])  # bravo
            assert salts[3] is None  # a key without a tenant: the shared namespace
            assert salts[4] == f"{salts[2]}:own"
            # rotation: bravo's key replaced while the router runs
            write_atomically(keys_file, KEYS_FILE.replace(KEY_B, "sk-bravo-new"))
            await asyncio.sleep(1.2)
            assert (
                await rr.client.post(url, json=completion(), headers=bearer(KEY_B))
            ).status_code == 401
            resp = await rr.client.post(url, json=completion(), headers=bearer("sk-bravo-new"))
            assert resp.status_code == 200 and a.received[-1]["cache_salt"] == salts[2]

    run(scenario())


def test_a_tenant_cannot_tell_from_the_tokenizer_cache_what_another_sent(
    keys_file: Path, tokenizer: Tokenizer
) -> None:
    """The router caches encoded chunks and prompt heads; a hit answers sooner (a request
    failing right after tokenizing: ~1 ms for a known text, ~24 ms for a new one). Each tenant
    hits only its own texts: another tenant's identical request encodes every chunk afresh."""
    text = " ".join(f"alpha-merger-figure-{i}" for i in range(120)) + "\nQuestion: approved?"
    probe = completion(text, truncate_prompt_tokens=8, truncation_side="middle")

    async def scenario() -> None:
        async with fakes("ok") as (a,):
            async with running_router(tokenizer, [a], api_keys_file=str(keys_file)) as rr:
                encoder = rr.router.tokenizer.encoder

                async def encoded(key: str) -> int:
                    """Chunks the probe made the router encode (a 400 after tokenizing)."""
                    before = encoder.encoded_chunks
                    resp = await rr.client.post(
                        rr.url + "/v1/completions", json=probe, headers=bearer(key)
                    )
                    assert resp.status_code == 400
                    assert resp.json()["error"]["param"] == "truncation_side"
                    return encoder.encoded_chunks - before

                chunks = await encoded(KEY_A1)
                assert chunks > 1
                assert await encoded(KEY_A2) == 0  # alpha's other key: alpha's own cache
                assert await encoded(KEY_B) == chunks  # bravo: as if never seen
                assert await encoded(KEY_SHARED) == chunks  # the shared namespace: the same
                assert await encoded(KEY_B) == 0 and await encoded(KEY_SHARED) == 0
            # without keys the router is single-tenant: one cache, whatever salt a client sends
            async with running_router(tokenizer, [a]) as rr:
                encoder = rr.router.tokenizer.encoder
                other = completion(text + " (again)", truncate_prompt_tokens=-2)
                url = rr.url + "/v1/completions"
                assert (await rr.client.post(url, json=other)).status_code == 400
                before = encoder.encoded_chunks
                resp = await rr.client.post(url, json={**other, "cache_salt": "t-mine"})
                assert resp.status_code == 400 and encoder.encoded_chunks == before
            assert a.received == []

    run(scenario())


def test_a_tenant_cannot_join_or_move_another_tenants_session(
    keys_file: Path, tokenizer: Tokenizer
) -> None:

    async def scenario() -> None:
        async with (
            fakes("ok", "ok") as reps,
            running_router(tokenizer, reps, api_keys_file=str(keys_file), strategy="session") as rr,
        ):
            url = rr.url + "/v1/completions"

            async def replica(key: str, i: int) -> str:
                resp = await rr.client.post(
                    url, json=completion(f"q{i}"), headers={**bearer(key), "x-session-id": "s1"}
                )
                assert resp.status_code == 200
                return resp.headers["x-kvtier-replica"]

            alpha = await replica(KEY_A1, 0)
            other = next(r.url for r in reps if r.url != alpha)
            # alpha's replica busy: a session of its own would stay, a new one goes elsewhere
            rr.router.replicas[alpha].queued_prefill_tokens += 10_000
            try:
                assert await replica(KEY_B, 1) == other
                assert await replica(KEY_SHARED, 2) == other
                assert await replica(KEY_A2, 3) == alpha
            finally:
                rr.router.replicas[alpha].queued_prefill_tokens -= 10_000

    run(scenario())


def test_no_key_shows_in_logs_errors_metrics_or_models(
    keys_file: Path, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    secrets = (KEY_A1, KEY_A2, KEY_B, KEY_SHARED)
    seen: list[str] = []

    async def scenario() -> None:
        async with (
            fakes("ok") as (a,),
            running_router(tokenizer, [a], api_keys_file=str(keys_file)) as rr,
        ):
            url = rr.url
            for headers in (bearer(KEY_A1 + "x"), bearer(KEY_A1[:-1]), {"Authorization": KEY_B}):
                resp = await rr.client.post(
                    url + "/v1/completions", json=completion(), headers=headers
                )
                assert resp.status_code == 401
                seen.append(resp.text)
            for body in (b"{", b'{"model": 5}', b"[]"):
                resp = await rr.client.post(
                    url + "/v1/chat/completions", content=body, headers=bearer(KEY_A1)
                )
                seen.append(resp.text)
            for path in ("/v1/models", "/metrics", "/health", "/nothing"):
                seen.append((await rr.client.get(url + path, headers=bearer(KEY_B))).text)
            seen.append(repr(rr.router.config))

    with caplog.at_level(logging.DEBUG):
        run(scenario())
    seen.append(caplog.text)
    for text in seen:
        for secret in secrets:
            assert secret not in text


def test_a_shared_namespace_key_cannot_send_a_tenant_s_salt_as_its_own() -> None:
    """Tenant salts are computable (unless the operator set a secret): a key without a tenant,
    or of a shared tenant, that sends one would share that tenant's cached blocks."""
    keys = ApiKeys(
        None, environ={"KVTIER_API_KEYS": "alpha sk-a,sk-shared"}, shared_tenants=["pub"]
    )
    alpha = keys.cache_salt("alpha", None)
    assert isinstance(alpha, str) and alpha.startswith(TENANT_SALT_PREFIX)
    for tenant in (None, "pub"):
        for forged in (alpha, f"{alpha}:mine", TENANT_SALT_PREFIX):
            with pytest.raises(BadRequest) as caught:
                keys.cache_salt(tenant, forged)
            assert caught.value.status == 400 and caught.value.param == "cache_salt"
        assert keys.cache_salt(tenant, "own") == "own" and keys.cache_salt(tenant, None) is None
    assert keys.cache_salt("alpha", alpha) == f"{alpha}:{alpha}"  # nested: still alpha's own
    assert ApiKeys(None, environ={}).cache_salt(None, alpha) == alpha  # no keys: left alone
