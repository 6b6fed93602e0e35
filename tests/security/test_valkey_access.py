"""The Valkey L2 behind AUTH, ACL users and TLS: the tier authenticates with a password from a
file or the environment, speaks TLS verified against a CA, and never shows the password."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
import valkey

from kvtier.core.settings import StoreSettings
from kvtier.core.tiers.shared import open_shared_l2
from kvtier.core.tiers.valkey import PASSWORD_ENV, ValkeyTier, ValkeyTierSettings
from kvtier.tools.l2ops.valkey_server import ValkeyServer
from tests.helpers.tiers import NAMESPACE, hash_of, meta_for, payload_for

pytestmark = pytest.mark.valkey

PASSWORD = "s3cret-valkey-pw"
ACL_USER, ACL_PASSWORD = "kvtier", "acl-pw-42"


@pytest.fixture(scope="module")
def locked(valkey_server: ValkeyServer) -> Iterator[ValkeyServer]:
    """The module's server with a password on the default user and an ACL user."""
    admin = valkey.Valkey(host="127.0.0.1", port=valkey_server.port)
    admin.acl_setuser(
        ACL_USER, enabled=True, passwords=[f"+{ACL_PASSWORD}"], keys=["*"], commands=["+@all"]
    )
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    yield valkey_server


def roundtrip(tier: ValkeyTier, name: str) -> bool:
    h = hash_of(name)
    tier.put(h, meta_for(4096), payload_for(h, 4096))
    block = tier.get(h)
    return block is not None and bytes(block.payload) == payload_for(h, 4096)


def settings(url: str, **extra: object) -> ValkeyTierSettings:
    return ValkeyTierSettings(url=url, backoff_initial_s=0.01, backoff_max_s=0.01, **extra)


@pytest.mark.parametrize("password", [None, "wrong-" + PASSWORD])
def test_without_the_password_every_call_is_a_counted_miss_logged_as_refused(
    locked: ValkeyServer,
    password: str | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if password is not None:
        monkeypatch.setenv(PASSWORD_ENV, password)
    with caplog.at_level(logging.WARNING):
        tier = ValkeyTier(settings(locked.url), NAMESPACE)
        assert not roundtrip(tier, "a")
    assert tier.stats().errors >= 1
    tier.close()
    # the operator is told to check the credentials, not the network
    assert "refused kvtier's credentials" in caplog.text and PASSWORD_ENV in caplog.text
    assert "unreachable" not in caplog.text


def test_the_password_from_a_file_or_the_environment_authenticates(
    locked: ValkeyServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text(PASSWORD + "\n")
    with caplog.at_level(logging.DEBUG):
        tier = ValkeyTier(settings(locked.url, password_file=str(password_file)), NAMESPACE)
        assert roundtrip(tier, "file")
        tier.close()
        monkeypatch.setenv(PASSWORD_ENV, ACL_PASSWORD)
        tier = ValkeyTier(settings(locked.url, username=ACL_USER), NAMESPACE)
        assert roundtrip(tier, "acl")
        tier.close()
        # through the store's settings too, with a wrong password: misses, nothing shown
        monkeypatch.setenv(PASSWORD_ENV, "wrong-" + PASSWORD)
        config = StoreSettings(l2_url=locked.url, l2_username=ACL_USER)
        shared = open_shared_l2(config, _identity())
        assert shared is not None and shared.tier.get(hash_of("acl")) is None
        shared.close()
    for text in (caplog.text, repr(config), repr(tier.stats())):
        assert PASSWORD not in text and ACL_PASSWORD not in text


def _identity():
    from kvtier.core.keys import ModelIdentity

    return ModelIdentity(model="m", block_tokens=4)


class TlsProxy:
    """A TLS endpoint in front of the plain server (as stunnel or a TLS-built server would be)."""

    def __init__(self, target_port: int, context: ssl.SSLContext) -> None:
        self._target = target_port
        self._context = context
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self._context)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_tls_is_verified_against_the_configured_ca(locked: ValkeyServer, tmp_path: Path) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    password_file = tmp_path / "pw"
    password_file.write_text(PASSWORD)
    proxy = TlsProxy(locked.port, server_context)
    try:
        url = f"rediss://127.0.0.1:{proxy.port}"
        trusted = ValkeyTier(
            settings(url, password_file=str(password_file), tls_ca_file=str(ca_file)), NAMESPACE
        )
        assert roundtrip(trusted, "tls")
        trusted.close()
        untrusted = ValkeyTier(settings(url, password_file=str(password_file)), NAMESPACE)
        assert not roundtrip(untrusted, "tls-2")  # the system's CAs do not sign this server
        assert untrusted.stats().errors >= 1
        untrusted.close()
    finally:
        proxy.close()
