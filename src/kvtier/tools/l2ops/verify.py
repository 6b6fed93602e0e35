"""Check every stored L2 object against its header and checksum (`kvtier l2 verify`).

Readers already validate every block they load, so this is an operator's tool: after a crash,
a file-system incident or a format change, it finds what would be a miss and can remove it.
Works on a shared directory (every namespace under the root) and on a Valkey L2.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import valkey

from kvtier.core.codec import HEADER_BYTES, decode_header, verify_payload
from kvtier.core.errors import CodecError
from kvtier.core.keys import BlockHash, Namespace
from kvtier.core.tiers.usage import BLOCK_SUFFIX, scan
from kvtier.core.tiers.valkey import shard_clients


@dataclass(slots=True)
class VerifyReport:
    checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    """(object, reason) of every object that failed validation."""
    removed: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    """(file or directory, reason) of everything that could not be read: neither checked nor
    removed."""


def check_object(data: memoryview, namespace: Namespace, block_hash: BlockHash) -> None:
    """Raise `CodecError` unless `data` is a valid block `block_hash` of `namespace`."""
    header = decode_header(data[:HEADER_BYTES], namespace=namespace, block_hash=block_hash)
    verify_payload(header, data[HEADER_BYTES:])


def _key_parts(name: str) -> BlockHash:
    try:
        return BlockHash(bytes.fromhex(name))
    except ValueError as exc:
        raise CodecError(f"name: {name!r} is not a block hash") from exc


def verify_directory(root: str, *, remove: bool = False) -> VerifyReport:
    """Validate every `*.kvt` file of every namespace under `root`. Only a file that fails
    validation is bad (and removed with `remove`); one that cannot be read is unreadable."""
    usage = scan(root, temp_max_age_s=float("inf"), now=0.0)
    report = VerifyReport(unreadable=list(usage.unreadable))
    for entry in usage.blocks:
        rel = os.path.relpath(entry.path, root)
        namespace = Namespace(rel.split(os.sep, 1)[0])
        try:
            with open(entry.path, "rb") as f:
                data = memoryview(f.read())
        except FileNotFoundError:
            continue  # evicted while we walked
        except OSError as exc:
            report.unreadable.append((entry.path, exc.strerror or str(exc)))
            continue
        report.checked += 1
        try:
            check_object(
                data, namespace, _key_parts(os.path.basename(entry.path)[: -len(BLOCK_SUFFIX)])
            )
        except CodecError as exc:
            reason = str(exc)
            if remove:
                try:
                    with contextlib.suppress(FileNotFoundError):  # evicted: gone all the same
                        os.unlink(entry.path)
                    report.removed += 1
                except OSError as unlink_exc:
                    reason += f"; not removed: {unlink_exc.strerror}"
            report.bad.append((entry.path, reason))
    return report


def _valkey_blocks(client: valkey.Valkey) -> Iterator[str]:
    for key in client.scan_iter(match="*:*", count=500):
        name = key.decode(errors="replace")
        if not name.endswith(":manifest"):
            yield name


def verify_valkey(url: str, *, remove: bool = False) -> VerifyReport:
    """Validate every `<namespace>:<hash>` value in the Valkey L2 at `url` (on every primary of
    a cluster)."""
    report = VerifyReport()
    with shard_clients(url) as clients:
        for client in clients:
            _verify_server(client, report, remove=remove)
    return report


def _verify_server(client: valkey.Valkey, report: VerifyReport, *, remove: bool) -> None:
    for key in _valkey_blocks(client):
        value = cast("bytes | None", client.get(key))
        if value is None:
            continue  # evicted while we scanned
        report.checked += 1
        namespace, _, hexhash = key.partition(":")
        try:
            check_object(memoryview(value), Namespace(namespace), _key_parts(hexhash))
        except CodecError as exc:
            report.bad.append((key, str(exc)))
            if remove:
                client.delete(key)  # 0 if evicted meanwhile: gone all the same
                report.removed += 1
