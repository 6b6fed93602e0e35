"""Router API keys and the tenants they belong to.

Keys come from three places, merged:

    RouterSettings.api_key        one key on the command line or in a file of settings (visible
                                  in process listings: prefer the two below)
    $KVTIER_API_KEYS              keys in the environment, read once at start-up
    RouterSettings.api_keys_file  keys in a file, re-read when it changes (rotation without a
                                  restart: write the new file next to it, rename it into place)

In the environment and the file, each entry is `KEY` or `TENANT KEY` (one per line; in the
environment also comma-separated); `#` starts a comment. A request to `/v1/*` must carry
`Authorization: Bearer KEY`. The presented key is hashed and compared, in constant time, with
the digest of every known key (no early exit, so the time taken says nothing about which key
nearly matched); keys are kept only as digests, and no key is ever logged or echoed.

Tenants and the cache: a named tenant's requests get a tenant-specific `cache_salt`, which vLLM
and the kvtier connector mix into every block hash, so two tenants never share a cached block
(no hit, and no timing difference to probe for another tenant's prompts). The salt is
`blake2b(tenant, key=$KVTIER_TENANT_SALT_KEY)`, stable across routers and restarts; a salt the
client sends itself is kept *inside* its tenant's (`<tenant salt>:<client salt>`), so it can
split its own cache further but never reach another tenant's namespace. Keys without a tenant,
and tenants listed in `shared_cache_tenants`, share the unsalted namespace (the operator's
choice); their own salt may not begin with `t-`, the tenant salts' prefix (a 400), so it cannot
name a tenant's namespace either. Without any key the router does not authenticate and leaves
`cache_salt` alone: one tenant.

The router's own state is per tenant too (a hit there answers sooner, another timing probe):
its tokenizer caches are keyed by `tenant_salt` (`kvtier.router.chunked_encoder`), sticky
sessions by the tenant (`kvtier.router.policies.simple.SessionPolicy`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvtier.core.errors import ConfigError
from kvtier.router.openai_request import BadRequest

__all__ = ["KEYS_ENV", "SALT_KEY_ENV", "TENANT_SALT_PREFIX", "ApiKeys", "Denied", "parse_keys"]

log = logging.getLogger(__name__)

KEYS_ENV = "KVTIER_API_KEYS"
"""Environment variable holding API keys (`KEY` or `TENANT KEY` entries)."""
SALT_KEY_ENV = "KVTIER_TENANT_SALT_KEY"
"""Environment variable holding the secret the tenant salts are derived with (optional)."""
TENANT_SALT_PREFIX = "t-"
"""How every tenant salt begins; a key of the shared namespace may not send a salt so."""
RELOAD_INTERVAL_S = 1.0
"""How often, at most, the keys file is checked for a change (one stat)."""
MAX_KEYS_FILE_BYTES = 1 << 20
_BEARER = "bearer "


class Denied(Exception):
    """No valid API key was presented (answered 401)."""


@dataclass(frozen=True, slots=True)
class _Key:
    digest: bytes
    tenant: str | None


def _reserved(client_salt: object) -> bool:
    """Whether a client's salt begins as tenant salts do (it could name a tenant's namespace)."""
    return isinstance(client_salt, str) and client_salt.startswith(TENANT_SALT_PREFIX)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def parse_keys(text: str, where: str) -> list[tuple[str, str | None]]:
    """(key, tenant) entries of a keys file or variable; a bad line is a ConfigError naming its
    line number (never its content: it may hold a key)."""
    entries: list[tuple[str, str | None]] = []
    for number, line in enumerate(text.replace(",", "\n").splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ConfigError(f"{where}: entry {number}: expected KEY or TENANT KEY")
        tenant, key = (None, fields[0]) if len(fields) == 1 else (fields[0], fields[1])
        entries.append((key, tenant))
    return entries


class ApiKeys:
    """The keys a router accepts and the tenant of each (see the module docstring).

    Called on the router's event loop, once per request (`authenticate`, `tenant_salt`,
    `cache_salt`).
    """

    def __init__(
        self,
        api_key: str | None = None,
        keys_file: str | None = None,
        shared_tenants: Iterable[str] = (),
        *,
        environ: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises ConfigError when a configured keys file cannot be read or parsed."""
        self._fixed = [_Key(_digest(k), t) for k, t in self._fixed_entries(api_key, environ)]
        self._file = keys_file
        self._file_keys: list[_Key] = []
        self._file_stamp: tuple[int, int, int] | None = None
        self._checked_at = -float("inf")
        self._clock = clock
        self._shared = frozenset(shared_tenants)
        self._salt_key = environ.get(SALT_KEY_ENV, "").encode() or b"kvtier-tenant-salt"
        self._salts: dict[str, str] = {}
        if keys_file is not None:
            self._load(strict=True)

    @staticmethod
    def _fixed_entries(
        api_key: str | None, environ: Mapping[str, str]
    ) -> list[tuple[str, str | None]]:
        entries: list[tuple[str, str | None]] = [] if api_key is None else [(api_key, None)]
        return entries + parse_keys(environ.get(KEYS_ENV, ""), f"${KEYS_ENV}")

    @property
    def enabled(self) -> bool:
        """Whether requests must present a key (any key is configured, or a keys file)."""
        return bool(self._fixed) or self._file is not None

    def __len__(self) -> int:
        self._maybe_reload()
        return len(self._fixed) + len(self._file_keys)

    # ----- keys file -----

    def _maybe_reload(self) -> None:
        if self._file is None:
            return
        now = self._clock()
        if now - self._checked_at < RELOAD_INTERVAL_S:
            return
        self._checked_at = now
        self._load(strict=False)

    def _load(self, *, strict: bool) -> None:
        """(Re)read the keys file if it changed. At start-up (`strict`) any problem is a
        ConfigError; later one is logged and the previous keys stay in force."""
        assert self._file is not None
        try:
            st = os.stat(self._file)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._file_stamp:
                return
            if st.st_size > MAX_KEYS_FILE_BYTES:
                raise ConfigError(f"api_keys_file: {self._file} is larger than 1 MiB")
            with open(self._file, encoding="utf-8") as f:
                entries = parse_keys(f.read(), f"api_keys_file {self._file}")
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            message = exc if isinstance(exc, ConfigError) else f"cannot read {self._file}: {exc}"
            if strict:
                raise ConfigError(f"api_keys_file: {message}") from exc
            log.warning("kvtier router: keys file not reloaded, previous keys kept: %s", message)
            return
        self._file_keys = [_Key(_digest(k), t) for k, t in entries]
        if self._file_stamp is not None:
            log.info("kvtier router: %d API keys loaded from %s", len(entries), self._file)
        self._file_stamp = stamp

    # ----- per request -----

    def authenticate(self, authorization: str) -> str | None:
        """The tenant of the key in an `Authorization` header value (None: a key of the shared
        namespace); raises Denied when it holds no valid key."""
        self._maybe_reload()
        if authorization[: len(_BEARER)].lower() != _BEARER:
            raise Denied
        digest = _digest(authorization[len(_BEARER) :].strip())
        found: _Key | None = None
        for key in (*self._fixed, *self._file_keys):  # every key, whichever matches
            if hmac.compare_digest(digest, key.digest):
                found = key
        if found is None:
            raise Denied
        return found.tenant

    def tenant_salt(self, tenant: str | None) -> str | None:
        """The salt of `tenant`'s own cache namespace, the same string object every time;
        None for the shared namespace (no tenant, a shared tenant)."""
        if tenant is None or tenant in self._shared:
            return None
        salt = self._salts.get(tenant)
        if salt is None:
            mac = hashlib.blake2b(tenant.encode(), key=self._salt_key[:64], digest_size=16)
            salt = self._salts.setdefault(tenant, TENANT_SALT_PREFIX + mac.hexdigest())
        return salt

    def cache_salt(self, tenant: str | None, client_salt: object) -> object:
        """The `cache_salt` to forward for a request of `tenant` that carried `client_salt`
        (returned as is for the shared namespace, or without keys). Raises BadRequest (400) for
        a shared-namespace salt in the tenants' reserved prefix: it could name a tenant's."""
        salt = self.tenant_salt(tenant)
        if salt is None:
            if self.enabled and _reserved(client_salt):
                raise BadRequest(
                    400,
                    f"'cache_salt' must not start with {TENANT_SALT_PREFIX!r} (reserved)",
                    "cache_salt",
                )
            return client_salt
        return salt if client_salt is None else f"{salt}:{client_salt}"
