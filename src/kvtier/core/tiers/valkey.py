"""L2 on Valkey (or Redis 7): the same blocks as the POSIX tier, one key per block.

    key    <namespace>:<block hash hex>       value  `kvtier.core.codec` header + payload
    key    <namespace>:manifest              value  the model identity (JSON), for humans

Writes publish if absent (`SET key value NX`): replicas finishing the same prefix store it once
and a stored block is never replaced, so readers only see complete values. Capacity is the
server's job: run it with `maxmemory` and `maxmemory-policy allkeys-lru` (what
`kvtier.tools.l2ops.valkey_server` does), and the server evicts least-recently-used blocks itself.

Batched calls (`contains_many`, `get_many`) are one pipelined round trip for many blocks (one per
shard holding some, shard after shard, on a cluster), which
is what a prefix lookup over a network needs; the single-block calls of the tier protocol are
thin wrappers. Large values are sent as they are (`set_if_absent`); replies are parsed by
libvalkey (C), which valkey-py uses when it is installed.

Faults never reach the caller. A lost connection (server restarted, network gone) turns the
call into misses or a failed put, counted in `errors`; the tier then stops talking to the
server for a backoff that doubles from `backoff_initial_s` to `backoff_max_s` (so a dead server
costs lookups nothing; each call skipped meanwhile counts in `errors` too). One fault doubles
it once, however many threads' calls it failed together; when it ends, one call tries the
server while the others go on skipping. A value that fails validation is a miss, deleted and
counted, and so is a key of another type (a hash, a list, written under the namespace by some
other client): EXISTS finds it, so left alone it would be a lookup hit whose load fails,
forever. Its GET answers WRONGTYPE, taken as a nil like an absent key, so a nil is looked at
with TYPE, one more round trip on misses only. A server error on one command is counted in
`errors` and turns the call into misses; it is never raised. A block whose value would exceed
the server's `proto-max-bulk-len` (asked at start; 512 MiB if CONFIG is refused) is not sent,
since the server drops the connection that sends it: the put fails, counted in `rejected`.

Cluster mode: at the first contact the tier asks the server for its slots (`CLUSTER SLOTS`,
`kvtier.core.tiers.valkey_shards`); in cluster mode it keeps a client per primary and sends
each key to the one holding its slot, a batch as one pipeline per shard. Every command names
one key, so nothing is refused as CROSSSLOT. A reply saying the slots moved or are not served
(MOVED, ASK, CLUSTERDOWN, TRYAGAIN), a slot the map gives no shard, or a shard out of reach, is
an outage like a server down: the tier pauses and drops the cluster's clients, and the call
that ends the pause asks for the slots again, of the URL's node, else of the other nodes the
last map named. Nothing is redirected or retried within a call, so a shard that hangs costs a
batch one timeout. A server refusing CLUSTER SLOTS (an ACL user not granted it) is taken as a
single server, whose clients outlive its faults (their pool reconnects).

Access control: `username` and a password (from `password_file` or $KVTIER_L2_PASSWORD, read
once at start, never logged: logged URLs are redacted) authenticate to a server with
`requirepass` or ACL users; a `rediss://` URL speaks TLS, verified against `tls_ca_file`. A
server refusing the credentials (none given, or wrong) is paused like an outage, and logged as
a refusal naming the settings to check, not as unreachable.

Thread-safe: the client's connection pool hands each concurrent call its own connection.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Self, cast

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
from kvtier.core.tiers.valkey_shards import ShardFault, Shards, open_shards

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

PASSWORD_ENV = "KVTIER_L2_PASSWORD"
"""Environment variable holding the Valkey password when no `password_file` is given."""

MAX_BULK_DEFAULT = 512 * 1024**2
"""Valkey's and Redis's default `proto-max-bulk-len`: the largest value a SET may carry, assumed
when the server does not answer CONFIG GET (a managed service that disables it)."""

_ABSENT_OR_STRING = (b"none", b"string")
"""TYPE's answers for a key GET answered nil: absent, or written since."""


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
    """Connection health: after a fault, calls are skipped until `retry_at`; then one call (the
    probe) tries the server while the others go on skipping, for one more pause at most.

    One fault pauses once, however many calls it fails together: a call's failure doubles the
    pause only if no other fault was counted since the call was let through (`admit`'s token),
    so the calls in flight when the server died do not stretch a blip to `backoff_max_s`."""

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float]) -> None:
        self._initial, self._max, self._clock = initial_s, max_s, clock
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0
        self._faults = 0

    def admit(self) -> int | None:
        """A token for a call that may talk to the server now; None while it pauses."""
        with self._lock:
            if self._delay:
                now = self._clock()
                if now < self._retry_at:
                    return None
                self._retry_at = now + self._delay  # this call probes; the others keep skipping
            return self._faults

    def failed(self, token: int) -> float | None:
        """Record the fault of the call admitted with `token`: the new pause, or None when a
        fault counted since then already paused the calls."""
        with self._lock:
            if token != self._faults:
                return None
            self._faults += 1
            self._delay = min(self._max, max(self._initial, self._delay * 2))
            self._retry_at = self._clock() + self._delay
            return self._delay

    def succeeded(self) -> bool:
        """Record a success; True if this ends an outage."""
        with self._lock:
            recovered = self._delay > 0
            self._delay = 0.0
            return recovered


def _max_value_bytes(client: valkey.Valkey) -> int:
    """The server's `proto-max-bulk-len`, else (CONFIG refused) `MAX_BULK_DEFAULT`. A server
    sent a longer value drops the connection, which would look like an outage and pause every
    call. Raises a server out of reach (asked again at the next contact)."""
    try:
        reply = cast("dict[str, str]", client.config_get("proto-max-bulk-len"))
        return int(reply["proto-max-bulk-len"])
    except (valkey.exceptions.ResponseError, KeyError, TypeError, ValueError):
        return MAX_BULK_DEFAULT


_FAULTS = (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError, ShardFault)
"""What pauses the tier (and, on a cluster, makes it ask for the slots again after the pause):
the server, or a shard of its cluster, is out of reach or refuses kvtier's credentials; the
cluster's slots moved or are not served; a cluster URL names a database other than 0."""


def _fault(exc: Exception) -> str:
    """What a fault (one of `_FAULTS`) says of the server, for the log."""
    if isinstance(exc, valkey.exceptions.AuthenticationError):
        settings = f"l2_username, l2_password_file, ${PASSWORD_ENV}"
        return f"refused kvtier's credentials (check {settings})"
    if isinstance(exc, ShardFault):
        return "cluster not usable now"
    return "unreachable"


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
        self._options: dict[str, Any] = {
            "socket_connect_timeout": config.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "retry_on_timeout": False,
        }
        if config.username is not None:
            self._options["username"] = config.username
        password = _password(config)
        if password is not None:
            self._options["password"] = password
        if config.tls_ca_file is not None:
            self._options["ssl_ca_certs"] = config.tls_ca_file
        self._clients: tuple[Shards, Shards] | None = None
        """(reads and writes, lookups), made at the first contact with the server, and again
        after a fault of its cluster."""
        self._nodes: list[str] = []
        """The cluster's nodes the last map named: asked for a new map should the URL fail."""
        self._first_contact = True
        self._connecting = threading.Lock()
        self._backoff = _Backoff(config.backoff_initial_s, config.backoff_max_s, clock)
        self._counters = TierCounters()
        self._max_value_bytes = MAX_BULK_DEFAULT
        self._warned_too_large = False
        self._manifest = None if manifest is None else json.dumps(manifest, sort_keys=True)
        # The first contact, now: a server that is down is tried again after the backoff.
        self._call(lambda client: None, "connect")

    def _connect(self) -> tuple[Shards, Shards]:
        """Clients for the server, or for each shard of its cluster (`open_shards`): one set for
        reads and writes, one for lookups. At the first contact, learns the server's largest
        value and writes the manifest (with the lookups' short timeout). Raises what contacting
        it raised."""
        config = self._config
        timeouts = (config.socket_timeout_s, config.lookup_timeout_s)
        reads, lookups = open_shards(config.url, self._options, timeouts, self._nodes)
        try:
            if self._first_contact:
                self._max_value_bytes = _max_value_bytes(lookups.clients[0])
                self._write_manifest(lookups)
                self._first_contact = False
        except BaseException:
            reads.close()
            lookups.close()
            raise
        self._nodes = reads.nodes
        kind = f"a cluster of {len(reads.clients)} shards" if reads.cluster else "one server"
        log.info("kvtier L2 valkey: %s, %s", self._where, kind)
        return reads, lookups

    @property
    def tier(self) -> Tier:
        return Tier.L2

    def key(self, block_hash: BlockHash) -> str:
        return self._prefix + block_hash.hex()

    # ---- the one place that talks to the server ------------------------------------------

    def _call(self, fn: Callable[[Shards], Any], op: str, *, lookup: bool = False) -> Any | None:
        """Run `fn(shards)` (the lookups' clients with `lookup`, else the reads' and writes');
        None when the server is in backoff or the call failed (both counted in `errors`: a call
        skipped in the backoff is a lost read or write too). A fault of a cluster drops the
        clients: the call that ends the pause asks for the slots again."""
        token = self._backoff.admit()
        if token is None:
            self._counters.add(errors=1)
            return None
        clients = None
        try:
            clients = self._connected()
            result = fn(clients[1] if lookup else clients[0])
        except _FAULTS as exc:
            self._counters.add(errors=1)
            if clients is not None and (clients[0].cluster or isinstance(exc, ShardFault)):
                self._drop(clients)
            delay = self._backoff.failed(token)
            if delay is None:  # another call's failure already paused (and logged) this fault
                return None
            log.warning(
                "kvtier L2 valkey %s: %s %s (%s); misses for %.1f s",
                op,
                self._where,
                _fault(exc),
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

    def _write_manifest(self, shards: Shards) -> None:
        """The model identity under `<namespace>:manifest`, unless there; for humans only, so a
        server refusing it (OOM, an ACL) is logged, not a fault."""
        if self._manifest is None:
            return
        key, body = self._prefix + "manifest", self._manifest
        try:
            shards.one(key, lambda client: client.set(key, body, nx=True))
        except valkey.exceptions.ResponseError as exc:
            log.warning("kvtier L2 valkey: manifest not written: %s", exc)

    def _connected(self) -> tuple[Shards, Shards]:
        clients = self._clients
        if clients is None:
            with self._connecting:
                clients = self._clients
                if clients is None:
                    clients = self._clients = self._connect()
        return clients

    def _drop(self, clients: tuple[Shards, Shards]) -> None:
        """Forget `clients` unless others replaced them already (calls still using them finish
        on them: they close when the last lets go)."""
        with self._connecting:
            if self._clients is clients:
                self._clients = None

    # ---- batched reads -------------------------------------------------------------------

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Existence of each block, in one pipelined round trip (per shard on a cluster)."""
        if not hashes:
            return []

        def run(shards: Shards) -> list[int]:
            return shards.each([self.key(h) for h in hashes], lambda pipe, key: pipe.exists(key))

        found = self._call(run, "exists", lookup=True)
        return [bool(n) for n in found] if found is not None else [False] * len(hashes)

    def get_many(self, hashes: Sequence[BlockHash]) -> list[StoredBlock | None]:
        """Each block (None on a miss), fetched in one pipelined round trip of GETs (per shard on
        a cluster): one key per command, where an MGET of keys in different hash slots would be
        refused in cluster mode (CROSSSLOT)."""
        if not hashes:
            return []

        def run(shards: Shards) -> list[bytes | None]:
            keys = [self.key(h) for h in hashes]
            replies = shards.each(keys, lambda pipe, key: pipe.get(key), raise_on_error=False)
            # A key's error (WRONGTYPE: a key of another type) is a nil, as MGET answers it;
            # the TYPE check of the nils removes such a key, or counts the error it answers too.
            return [None if isinstance(r, valkey.exceptions.ResponseError) else r for r in replies]

        values = self._call(run, "get")
        if values is None:
            self._counters.add(misses=len(hashes))
            return [None] * len(hashes)
        blocks = [self._decode(h, v) for h, v in zip(hashes, values, strict=True)]
        nil = [h for h, v in zip(hashes, values, strict=True) if v is None]
        if nil:
            self._remove_foreign(nil)
        return blocks

    def _remove_foreign(self, hashes: Sequence[BlockHash]) -> None:
        """Delete the keys of `hashes` (GET answered them nil) that hold another type than a
        string: not blocks, and in the way of the block's `SET NX`."""

        def run(shards: Shards) -> list[bytes]:
            return shards.each([self.key(h) for h in hashes], lambda pipe, key: pipe.type(key))

        types = self._call(run, "type")
        if types is None:
            return
        foreign = {h: t for h, t in zip(hashes, types, strict=True) if t not in _ABSENT_OR_STRING}
        if not foreign:
            return
        for h, t in foreign.items():
            log.warning("kvtier L2 valkey: removing %s: a %s, not a block", self.key(h), t.decode())

        def delete(shards: Shards) -> int:
            keys = [self.key(h) for h in foreign]  # one key per DEL: no CROSSSLOT in a cluster
            return sum(shards.each(keys, lambda pipe, key: pipe.delete(key)))

        removed = self._call(delete, "delete")
        self._counters.add(corrupt_removed=removed or 0)

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
            removed = self._delete(block_hash)
            self._counters.add(misses=1, corrupt_removed=removed or 0)
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
        if HEADER_BYTES + view.nbytes > self._max_value_bytes:
            self._counters.add(rejected=1)
            if not self._warned_too_large:  # once: every block of the model is as large
                self._warned_too_large = True
                log.warning(
                    "kvtier L2 valkey: not storing blocks of %d bytes, over the server's "
                    "proto-max-bulk-len (%d); counted in `rejected`",
                    HEADER_BYTES + view.nbytes,
                    self._max_value_bytes,
                )
            return PutResult(stored=False)
        value = (encode_header(self._namespace, block_hash, meta, view), view)
        key = self.key(block_hash)
        # None from _call: the call failed
        created = self._call(
            lambda shards: shards.one(key, lambda c: set_if_absent(c, key, value)), "set"
        )
        if created:
            self._counters.add(stored=1, bytes_written=view.nbytes)
            return PutResult(stored=True)
        if created is not None:  # NX refused: another replica published it first
            self._counters.add(already_present=1)
        return PutResult(stored=False)

    def remove(self, block_hash: BlockHash) -> bool:
        return bool(self._delete(block_hash))

    def _delete(self, block_hash: BlockHash) -> int | None:
        """DEL of the block's key: 1 or 0 keys removed, None when the call failed."""
        key = self.key(block_hash)
        return self._call(lambda shards: shards.one(key, lambda c: c.delete(key)), "delete")

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._connecting:
            clients, self._clients = self._clients, None
        for shards in clients or ():
            shards.close()


def set_if_absent(client: valkey.Valkey, key: str, pieces: Sequence[Buffer]) -> bool:
    """`SET key value NX`, the value being `pieces` joined; True when it was stored, False when
    the key existed. The pieces go to the socket as they are (a RESP bulk string may arrive in
    any number of writes): a block's header and payload are never copied into one value.
    Raises what the client's own commands raise; a connection that failed mid-command is
    closed, never reused with a reply still on its way."""
    views = [byte_view(piece) for piece in pieces]
    name = key.encode()
    size = sum(view.nbytes for view in views)
    command = [
        b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size),
        *views,
        b"\r\n$2\r\nNX\r\n",
    ]
    pool = client.connection_pool
    conn = pool.get_connection("SET")
    try:
        conn.send_packed_command(command)
        return conn.read_response() is not None
    except valkey.exceptions.ResponseError:
        raise  # an error reply, read whole: the connection is in step
    except BaseException:
        conn.disconnect()  # (both calls do on their faults; not between them, on an interrupt)
        raise
    finally:
        pool.release(conn)


@contextmanager
def shard_clients(url: str) -> Iterator[list[valkey.Valkey]]:
    """One client per server holding keys: the server at `url`, or each primary of the cluster
    it belongs to (a key lives on one of them, and its SCAN lists only its own). Closed on
    exit."""
    (shards,) = open_shards(url, {}, [None])
    try:
        yield shards.clients
    finally:
        shards.close()
