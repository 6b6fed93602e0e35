"""One-key commands sent to a Valkey server, or to the shards of a Valkey cluster.

`open_shards(url, ...)` asks the server whether it runs in cluster mode (`CLUSTER SLOTS`, on
database 0) and returns `Shards`: one plain client per primary and which hash slots each
holds (a single server: one client holding them all). A batch runs as one pipeline per shard
holding some of its keys, the replies put back in the keys' order.

Nothing is redirected or retried here: a reply saying the slots moved (MOVED, ASK), the cluster
cannot serve them (CLUSTERDOWN, TRYAGAIN) raises `ShardFault`, as does a cluster URL naming a
database other than 0, so that the caller treats it as an outage and opens new `Shards` from
the URL (a fresh map, fresh addresses) after its backoff. A shard that does not answer costs
one timeout per call, like a single server.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import valkey
from valkey.client import Pipeline
from valkey.connection import parse_url
from valkey.crc import key_slot

__all__ = ["ShardFault", "Shards", "open_shards"]

_SHARD_ERRORS = ("MOVED ", "ASK ", "CLUSTERDOWN", "TRYAGAIN")
"""How a server's error reply begins when the key's slot is not, or not now, its own."""


class ShardFault(Exception):
    """The cluster's slots moved or cannot be served, or the URL cannot name a cluster."""


def _shard_fault(reply: object) -> ShardFault | None:
    if isinstance(reply, valkey.exceptions.ResponseError) and str(reply).startswith(_SHARD_ERRORS):
        return ShardFault(str(reply))
    return None


class Shards:
    """Clients of the primaries (`clients`) and the slots each holds: the slot ranges start at
    `starts` (sorted) and belong to `clients[owners[i]]`; `cluster`: whether the server runs in
    cluster mode (a single server holds every key). Thread-safe (the clients' pools are)."""

    def __init__(
        self,
        clients: Sequence[valkey.Valkey],
        starts: Sequence[int],
        owners: Sequence[int],
        cluster: bool,
    ) -> None:
        self.clients = list(clients)
        self.cluster = cluster
        self._starts = list(starts)
        self._owners = list(owners)

    def _owner(self, key: str) -> int:
        if len(self.clients) == 1:
            return 0
        return self._owners[bisect.bisect_right(self._starts, key_slot(key.encode())) - 1]

    def one(self, key: str, fn: Callable[[valkey.Valkey], Any]) -> Any:
        """`fn(client)` on the client holding `key`; raises `ShardFault` where its reply says
        the key's slot is not served there."""
        try:
            return fn(self.clients[self._owner(key)])
        except valkey.exceptions.ResponseError as exc:
            raise _shard_fault(exc) or exc from None

    def each(
        self,
        keys: Sequence[str],
        add: Callable[[Pipeline, str], object],
        *,
        raise_on_error: bool = True,
    ) -> list[Any]:
        """`add(pipeline, key)` for every key, one pipeline per shard; the replies in the order
        of `keys`. Raises `ShardFault` where a reply says a slot moved or is not served, else
        (with `raise_on_error`) the first error reply; without, error replies are returned."""
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self._owner(key), []).append(i)
        replies: list[Any] = [None] * len(keys)
        for owner, indices in groups.items():
            pipe = self.clients[owner].pipeline(transaction=False)
            for i in indices:
                add(pipe, keys[i])
            answered = pipe.execute(raise_on_error=False)  # type: ignore[no-untyped-call]
            for i, reply in zip(indices, answered, strict=True):
                replies[i] = reply
        for reply in replies:
            fault = _shard_fault(reply)
            if fault is not None:
                raise fault
            if raise_on_error and isinstance(reply, Exception):
                raise reply
        return replies

    def close(self) -> None:
        for client in self.clients:
            client.close()  # type: ignore[no-untyped-call]


def open_shards(
    url: str, options: Mapping[str, Any], socket_timeouts: Sequence[float | None]
) -> list[Shards]:
    """`Shards` of the server at `url`, or of the cluster it belongs to, one per socket timeout
    in `socket_timeouts` (None: none; the same map; client `options`: connect timeout,
    credentials, TLS); the server is asked with the shortest.
    Raises what contacting the server raised, and `ShardFault` for a cluster that serves no
    slot or a cluster URL naming a database other than 0."""
    probe = valkey.Valkey.from_url(
        _on_database_0(url),
        socket_timeout=min((t for t in socket_timeouts if t is not None), default=None),
        **options,
    )
    try:
        slots = _cluster_slots(probe)
    finally:
        probe.close()  # type: ignore[no-untyped-call]
    if slots is None:
        nodes, starts, owners = [url], [0], [0]
    else:
        nodes, starts, owners = _shard_map(url, slots)
    opened: list[Shards] = []
    try:
        for timeout_s in socket_timeouts:
            shards = Shards([], starts, owners, cluster=slots is not None)
            opened.append(shards)
            for node in nodes:
                client = valkey.Valkey.from_url(node, socket_timeout=timeout_s, **options)
                shards.clients.append(client)
    except BaseException:
        for shards in opened:
            shards.close()
        raise
    return opened


def _shard_map(
    url: str, slots: list[tuple[int, int, tuple[str, int]]]
) -> tuple[list[str], list[int], list[int]]:
    """(each primary's URL, the slot ranges' starts, each range's primary) of a cluster whose
    `CLUSTER SLOTS` answered `slots`, reached as `url` is (scheme, credentials)."""
    parsed = parse_url(url)
    if int(parsed.get("db") or 0):
        raise ShardFault(f"a cluster has database 0 only; the URL names database {parsed['db']}")
    if not slots:
        raise ShardFault("the cluster serves no slot yet")
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    primaries: dict[str, int] = {}
    starts, owners = [], []
    for start, _end, (host, port) in sorted(slots):
        netloc = f"{host or parts.hostname}:{port}"
        node = urlunsplit(
            (parts.scheme, f"{userinfo}@{netloc}" if userinfo else netloc, "", "", "")
        )
        owners.append(primaries.setdefault(node, len(primaries)))
        starts.append(start)
    return list(primaries), starts, owners


def _on_database_0(url: str) -> str:
    """`url` without the database it names (a cluster refuses any other than 0 at connect)."""
    parts = urlsplit(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "db"])
    path = parts.path if parts.scheme == "unix" else ""
    return urlunsplit(parts._replace(path=path, query=query))


def _cluster_slots(client: valkey.Valkey) -> list[tuple[int, int, tuple[str, int]]] | None:
    """(first slot, last slot, primary's (host, port)) of each range, from `CLUSTER SLOTS`;
    None where the server is not in cluster mode or refuses the command (an ACL user not
    granted it: then taken as a single server)."""
    try:
        reply = cast("list[list[Any]]", client.execute_command("CLUSTER", "SLOTS"))  # type: ignore[no-untyped-call]
    except valkey.exceptions.ResponseError:
        return None
    return [
        (int(start), int(end), (bytes(primary[0]).decode(), int(primary[1])))
        for start, end, primary, *_replicas in reply
    ]
