"""One-key commands sent to a Valkey server, or to the shards of a Valkey cluster.

`open_shards(url, ...)` asks the server whether it runs in cluster mode (`CLUSTER SLOTS`, on
database 0) and returns `Shards`: one plain client per primary and the hash slots each holds
(a single server: one client holding them all). A batch runs as one pipeline per shard holding
some of its keys, shard after shard, the replies put back in the keys' order.

Nothing is redirected or retried here: a key whose slot the map gives no shard, or a reply
saying the slots moved (MOVED, ASK) or cannot be served (CLUSTERDOWN, TRYAGAIN), raises
`ShardFault`, as do a cluster URL naming a database other than 0 and a `CLUSTER SLOTS` reply
that cannot be read, so that the caller treats it as an outage and opens new `Shards` after
its backoff: from the URL, else from the other nodes the last map named (`Shards.nodes`: a
replica promoted in the URL's node's place answers). A shard that does not answer costs one
timeout per call, like a single server.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import valkey
from valkey.client import Pipeline
from valkey.connection import parse_url
from valkey.crc import key_slot

__all__ = ["ShardFault", "Shards", "open_shards"]

SLOTS = 16384
_SHARD_ERRORS = ("MOVED ", "ASK ", "CLUSTERDOWN", "TRYAGAIN")
"""How a server's error reply begins when the key's slot is not, or not now, its own."""
_NO_HOST = ("", "?")
"""Hosts `CLUSTER SLOTS` names when a node announces none: it is reached as the URL's host."""

SlotRange = tuple[int, int, str]
"""(first slot, last slot, the URL of the primary holding them)."""


class ShardFault(Exception):
    """The cluster's slots moved or cannot be served, or the URL cannot name a cluster."""


def _shard_fault(reply: object) -> ShardFault | None:
    if isinstance(reply, valkey.exceptions.ResponseError) and str(reply).startswith(_SHARD_ERRORS):
        return ShardFault(str(reply))
    return None


class Shards:
    """Clients of the primaries (`clients`) and the slots each holds (`ranges`, indices into
    `clients`); `cluster`: whether the server runs in cluster mode (a single server holds every
    key); `nodes`: the URLs of every node the map named, replicas included, to ask for a new
    map should the URL fail. Thread-safe (the clients' pools are)."""

    def __init__(
        self,
        clients: Sequence[valkey.Valkey],
        ranges: Sequence[tuple[int, int, int]],
        cluster: bool,
        nodes: Sequence[str] = (),
    ) -> None:
        self.clients = list(clients)
        self.cluster = cluster
        self.nodes = list(nodes)
        self._ranges = sorted(ranges)
        self._starts = [first for first, _, _ in self._ranges]

    def _owner(self, key: str) -> int:
        if not self.cluster:
            return 0
        slot = key_slot(key.encode())
        i = bisect.bisect_right(self._starts, slot) - 1
        if i < 0 or slot > self._ranges[i][1]:
            raise ShardFault(f"slot {slot} is served by no shard")
        return self._ranges[i][2]

    def one(self, key: str, fn: Callable[[valkey.Valkey], Any]) -> Any:
        """`fn(client)` on the client holding `key`; raises `ShardFault` where the key's slot
        is not served there."""
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
        of `keys`. Raises `ShardFault` where a slot is not served there, else (with
        `raise_on_error`) the first error reply; without, error replies are returned."""
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
    url: str,
    options: Mapping[str, Any],
    socket_timeouts: Sequence[float | None],
    fallbacks: Sequence[str] = (),
) -> list[Shards]:
    """`Shards` of the server at `url`, or of the cluster it belongs to, one per socket timeout
    in `socket_timeouts` (None: none), all on one map; client `options`: connect timeout,
    credentials, TLS. The map is asked of `url`, else of each of `fallbacks` (other nodes of the
    cluster) in turn, with the shortest timeout. Raises what asking the last one raised, and
    `ShardFault` for a cluster that serves no slot, a cluster URL naming a database other than
    0, or a map that cannot be read."""
    timeout = min((t for t in socket_timeouts if t is not None), default=None)
    ranges, nodes = _ask_map([url, *fallbacks], timeout, options)
    primaries = list(dict.fromkeys(node for _, _, node in ranges))
    owned = [(first, last, primaries.index(node)) for first, last, node in ranges]
    opened: list[Shards] = []
    try:
        for timeout_s in socket_timeouts:
            shards = Shards([], owned, cluster=bool(nodes), nodes=nodes)
            opened.append(shards)
            for node in primaries:
                client = valkey.Valkey.from_url(node, socket_timeout=timeout_s, **options)
                shards.clients.append(client)
    except BaseException:
        for shards in opened:
            shards.close()
        raise
    return opened


def _ask_map(
    urls: Sequence[str], timeout: float | None, options: Mapping[str, Any]
) -> tuple[list[SlotRange], list[str]]:
    """(the slot ranges, every node's URL) of the first of `urls` that answers with a map; a
    single server (`urls[0]` answering none): one range held by it, no nodes. Raises what the
    last one raised, or `ShardFault` where the other nodes answer no map."""
    for i, url in enumerate(urls):
        probe = valkey.Valkey.from_url(_on_database_0(url), socket_timeout=timeout, **options)
        try:
            reply = _cluster_slots(probe)
        except (valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError):
            if i == len(urls) - 1:
                raise
            continue
        finally:
            probe.close()  # type: ignore[no-untyped-call]
        if reply is not None:
            return _read_map(urls[0], reply, answered=url)
        if i == 0:
            return [(0, SLOTS - 1, url)], []
    raise ShardFault("no other node of the cluster answers CLUSTER SLOTS")


def _read_map(
    url: str, reply: object, answered: str | None = None
) -> tuple[list[SlotRange], list[str]]:
    """The slot ranges and every node's URL in `CLUSTER SLOTS`'s `reply` (from the node at
    `answered`, default `url`), each node reached as `url` is (scheme, credentials, options),
    at the host of `answered` where it announces none."""
    if urlsplit(url).scheme == "unix":
        raise ShardFault("a cluster's shards cannot be reached through a unix:// URL")
    if int(parse_url(url).get("db") or 0):
        raise ShardFault(f"a cluster has database 0 only; the URL names {urlsplit(url).path}")
    default_host = urlsplit(answered or url).hostname or "localhost"
    ranges: list[SlotRange] = []
    nodes: dict[str, None] = {}
    try:
        for first, last, *servers in reply:  # type: ignore[attr-defined]
            urls = [_node_url(url, server[0], int(server[1]), default_host) for server in servers]
            ranges.append((int(first), int(last), urls[0]))
            nodes.update(dict.fromkeys(urls))
    except (TypeError, ValueError, IndexError) as exc:
        raise ShardFault(f"unreadable CLUSTER SLOTS reply: {exc}") from None
    if not ranges:
        raise ShardFault("the cluster serves no slot yet")
    return ranges, list(nodes)


def _node_url(url: str, host: object, port: int, default_host: str) -> str:
    """`url` (its scheme, credentials and options, not its database) for the node at `host`
    (`default_host` where the node announces none) and `port`."""
    parts = urlsplit(_on_database_0(url))
    name = host.decode() if isinstance(host, bytes) else str(host or "")
    if name in _NO_HOST:
        name = default_host
    if ":" in name:  # an IPv6 address
        name = f"[{name}]"
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{name}:{port}" if userinfo else f"{name}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _on_database_0(url: str) -> str:
    """`url` without the database it names (a cluster refuses any other than 0 at connect)."""
    parts = urlsplit(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "db"])
    path = parts.path if parts.scheme == "unix" else ""
    return urlunsplit(parts._replace(path=path, query=query))


def _cluster_slots(client: valkey.Valkey) -> object | None:
    """`CLUSTER SLOTS`'s reply; None where the server is not in cluster mode or refuses the
    command (an ACL user not granted it: then taken as a single server)."""
    try:
        reply: object = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    except valkey.exceptions.ResponseError:
        return None
    return reply
