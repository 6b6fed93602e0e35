"""L2 on Valkey (or Redis 7): the same blocks as the POSIX tier, one key per block.

    key    <namespace>:<block hash hex>       value  `kvtier.core.codec` header + payload
    key    <namespace>:manifest              value  the model identity (JSON), for humans

Writes publish if absent (`SET key value NX`): replicas finishing the same prefix store it once
and a stored block is never replaced, so readers only see complete values. Capacity is the
server's job: run it with `maxmemory` and `maxmemory-policy allkeys-lru` (what
`kvtier.tools.l2ops.valkey_server` does), and the server evicts least-recently-used blocks itself.

Batched calls (`contains_many`, `get_many`) are one pipelined round trip for many blocks, which
is what a prefix lookup over a network needs; the single-block calls of the tier protocol are
thin wrappers.

Faults never reach the caller. A lost connection (server restarted, network gone) turns the
call into misses or a failed put, counted in `errors`; the tier then stops talking to the
server for a backoff that doubles from `backoff_initial_s` to `backoff_max_s` (so a dead server
costs lookups nothing; each call skipped meanwhile counts in `errors` too) and the first call
after it reconnects. A value that fails validation
is a miss, deleted and counted, and so is a key of another type (a hash, a list, written under
the namespace by some other client): EXISTS finds it, so left alone it would be a lookup hit
whose load fails, forever. MGET answers it nil, like an absent key, so a nil is looked at with
TYPE, one more round trip on misses only. A server error on one command (WRONGTYPE among
them) is counted in `errors` and turns the call into misses; it is never raised.

Access control: `username` and a password (from `password_file` or $KVTIER_L2_PASSWORD, read
once at start, never logged: logged URLs are redacted) authenticate to a server with
`requirepass` or ACL users; a `rediss://` URL speaks TLS, verified against `tls_ca_file`.

Thread-safe: the client's connection pool hands each concurrent call its own connection.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Self

import valkey
from pydantic import Field, model_validator
from valkey.backoff import NoBackoff
from valkey.retry import Retry

from kvtier.core.codec import (
    HEADER_BYTES,
    BlockMeta,
    byte_view,
    decode_header,
    encode_header,
    verify_payload,
)
from kvtier.core.errors import CodecError, ConfigError
from kvtier.core.keys import BlockHash, Namespace
from kvtier.core.settings import L2_URL_SCHEMES, Settings, redact_url
from kvtier.core.tiers.base import PutResult, StoredBlock, Tier, TierCounters, TierStats

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

PASSWORD_ENV = "KVTIER_L2_PASSWORD"
"""Environment variable holding the Valkey password when no `password_file` is given."""

_ABSENT_OR_STRING = (b"none", b"string")
"""TYPE's answers for a key MGET may answer nil: absent, or written since."""


class ValkeyTierSettings(Settings):
    """Where the Valkey L2 lives and how hard to try when it is unreachable."""

    url: str
    """`redis://host:port[/db]` (also `rediss://` for TLS, `unix://`)."""
    username: str | None = None
    """ACL user to authenticate as; unset: the default user."""
    password_file: str | None = None
    """File holding the password; unset: $KVTIER_L2_PASSWORD, else no AUTH."""
    tls_ca_file: str | None = None
    """CA bundle (PEM) that signs the server's certificate (rediss://); unset: the system's."""
    socket_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Per-command timeout of reads and writes: a hung server costs them at most this. One
    batch of blocks is one reply of many megabytes, so keep it well above that transfer's
    time."""
    lookup_timeout_s: Annotated[float, Field(gt=0)] = 0.5
    """Timeout of an existence check (`contains_many`, the lookup on the scheduler's path): a
    reply of a few bytes per block, so a server that hangs costs a lookup this much, not
    `socket_timeout_s`, and the backoff after it turns the next lookups into instant misses."""
    connect_timeout_s: Annotated[float, Field(gt=0)] = 0.5
    """Connect timeout; short, because a down server must not stall a lookup."""
    backoff_initial_s: Annotated[float, Field(gt=0)] = 0.1
    """Pause after the first failed call before trying the server again."""
    backoff_max_s: Annotated[float, Field(gt=0)] = 5.0
    """Longest pause between attempts while the server stays unreachable."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.url.startswith(L2_URL_SCHEMES):
            raise ValueError(f"url: expected redis://host:port[/db], got {redact_url(self.url)!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s: must be >= backoff_initial_s "
                f"({self.backoff_initial_s}), got {self.backoff_max_s}"
            )
        return self


def _password(config: ValkeyTierSettings) -> str | None:
    """The password `config` names (file, else environment), or None."""
    if config.password_file is None:
        return os.environ.get(PASSWORD_ENV) or None
    try:
        with open(config.password_file, encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"l2_password_file: cannot read {config.password_file}: {exc}") from exc


class _Backoff:
    """Connection health: after a fault, calls are skipped until `retry_at`."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float]) -> None:
        self._initial, self._max, self._clock = initial_s, max_s, clock
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0

    def ready(self) -> bool:
        return self._clock() >= self._retry_at

    def failed(self) -> float:
        with self._lock:
            self._delay = min(self._max, max(self._initial, self._delay * 2))
            self._retry_at = self._clock() + self._delay
            return self._delay

    def succeeded(self) -> bool:
        """Record a success; True if this ends an outage."""
        with self._lock:
            recovered = self._delay > 0
            self._delay = 0.0
            return recovered


class ValkeyTier:
    """Valkey/Redis L2 tier for one namespace (see the module docstring)."""

    def __init__(
        self,
        config: ValkeyTierSettings,
        namespace: Namespace,
        manifest: dict[str, object] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._where = redact_url(config.url)
        self._namespace = namespace
        self._prefix = f"{namespace}:"
        options: dict[str, Any] = {}
        if config.username is not None:
            options["username"] = config.username
        password = _password(config)
        if password is not None:
            options["password"] = password
        if config.tls_ca_file is not None:
            options["ssl_ca_certs"] = config.tls_ca_file
        self._client, self._lookup_client = (
            valkey.Valkey.from_url(
                config.url,
                socket_timeout=timeout_s,
                socket_connect_timeout=config.connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                **options,
            )
            for timeout_s in (config.socket_timeout_s, config.lookup_timeout_s)
        )
        self._backoff = _Backoff(config.backoff_initial_s, config.backoff_max_s, clock)
        self._counters = TierCounters()
        if manifest is not None:
            body = json.dumps(manifest, sort_keys=True)
            self._call(lambda c: c.set(self._prefix + "manifest", body, nx=True), "manifest")

    @property
    def tier(self) -> Tier:
        return Tier.L2

    def key(self, block_hash: BlockHash) -> str:
        return self._prefix + block_hash.hex()

    # ---- the one place that talks to the server ------------------------------------------

    def _call(
        self, fn: Callable[[valkey.Valkey], Any], op: str, client: valkey.Valkey | None = None
    ) -> Any | None:
        """Run `fn(client)` (default: the reads' and writes' client); None when the server is
        in backoff or the call failed (both counted in `errors`: a call skipped in the backoff
        is a lost read or write too)."""
        if not self._backoff.ready():
            self._counters.add(errors=1)
            return None
        try:
            result = fn(client or self._client)
        except (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError) as exc:
            self._counters.add(errors=1)
            delay = self._backoff.failed()
            log.warning(
                "kvtier L2 valkey %s: %s unreachable (%s); misses for %.1f s",
                op,
                self._where,
                exc,
                delay,
            )
            return None
        except valkey.exceptions.ValkeyError as exc:  # e.g. OOM under maxmemory noeviction
            self._counters.add(errors=1)
            log.warning("kvtier L2 valkey %s failed: %s", op, exc)
            return None
        if self._backoff.succeeded():
            log.warning("kvtier L2 valkey: %s reachable again", self._where)
        return result

    # ---- batched reads -------------------------------------------------------------------

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Existence of each block, in one pipelined round trip."""
        if not hashes:
            return []

        def run(client: valkey.Valkey) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return list(pipe.execute())  # type: ignore[no-untyped-call]

        found = self._call(run, "exists", self._lookup_client)
        return [bool(n) for n in found] if found is not None else [False] * len(hashes)

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        """Each block (None on a miss), fetched with one MGET."""
        if not hashes:
            return []
        values = self._call(lambda c: c.mget([self.key(h) for h in hashes]), "get")
        if values is None:
            self._counters.add(misses=len(hashes))
            return [None] * len(hashes)
        blocks = [self._decode(h, v) for h, v in zip(hashes, values, strict=True)]
        nil = [h for h, v in zip(hashes, values, strict=True) if v is None]
        if nil:
            self._remove_foreign(nil)
        return blocks

    def _remove_foreign(self, hashes: Sequence[BlockHash]) -> None:
        """Delete the keys of `hashes` (MGET answered them nil) that hold another type than a
        string: not blocks, and in the way of the block's `SET NX`."""

        def run(client: valkey.Valkey) -> list[bytes]:
            pipe = client.pipeline(transaction=False)
            for h in hashes:
                pipe.type(self.key(h))
            return list(pipe.execute())  # type: ignore[no-untyped-call]

        types = self._call(run, "type")
        if types is None:
            return
        foreign = {h: t for h, t in zip(hashes, types, strict=True) if t not in _ABSENT_OR_STRING}
        if not foreign:
            return
        for h, t in foreign.items():
            log.warning("kvtier L2 valkey: removing %s: a %s, not a block", self.key(h), t.decode())
        self._call(lambda c: c.delete(*(self.key(h) for h in foreign)), "delete")
        self._counters.add(corrupt_removed=len(foreign))

    def _decode(self, block_hash: BlockHash, value: bytes | None) -> StoredBlock | None:
        if value is None:
            self._counters.add(misses=1)
            return None
        view = memoryview(value)  # bytes: already read-only, never copied again
        try:
            header = decode_header(
                view[:HEADER_BYTES], namespace=self._namespace, block_hash=block_hash
            )
            payload = view[HEADER_BYTES:]
            verify_payload(header, payload)
        except CodecError as exc:
            log.warning("kvtier L2 valkey: removing invalid block %s: %s", block_hash.hex(), exc)
            self._call(lambda c: c.delete(self.key(block_hash)), "delete")
            self._counters.add(misses=1, corrupt_removed=1)
            return None
        self._counters.add(hits=1, bytes_read=payload.nbytes)
        return StoredBlock(header.meta, payload)

    # ---- the tier protocol ---------------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        return self.contains_many([block_hash])[0]

    def get(self, block_hash: BlockHash) -> StoredBlock | None:
        return self.get_many([block_hash])[0]

    def put(self, block_hash: BlockHash, meta: BlockMeta, payload: Buffer) -> PutResult:
        view = byte_view(payload)
        value = encode_header(self._namespace, block_hash, meta, view) + view
        # SET NX answers None when the key exists; bool() keeps None for "the call failed".
        created = self._call(lambda c: bool(c.set(self.key(block_hash), value, nx=True)), "set")
        if created:
            self._counters.add(stored=1, bytes_written=view.nbytes)
            return PutResult(stored=True)
        if created is not None:  # NX refused: another replica published it first
            self._counters.add(already_present=1)
        return PutResult(stored=False)

    def remove(self, block_hash: BlockHash) -> bool:
        return bool(self._call(lambda c: c.delete(self.key(block_hash)), "delete"))

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]
        self._lookup_client.close()  # type: ignore[no-untyped-call]
