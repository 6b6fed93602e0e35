"""Tenant cache salts (the rest of `kvtier.router.auth`: tests/security/test_auth.py)."""

from __future__ import annotations

import pytest

from kvtier.router.auth import TENANT_SALT_PREFIX, ApiKeys
from kvtier.router.openai_request import BadRequest


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
