"""The kvtier exception tree.

    KvtierError
    ├── ConfigError        (ValueError)  a setting is invalid; the message names the field
    ├── ModelError                        the embedded model could not be prepared or loaded
    ├── CodecError                        a stored block failed validation (treated as a miss)
    │   └── ChecksumError                 payload bytes do not match the header checksum
    ├── TierError                         an L1/L2 backend failed (treated as a miss, counted)
    └── RoutingError                      the router has no healthy replica for a request

    Terminated (KeyboardInterrupt)        a stop signal, raised where the command is

In the data path a tier fault never reaches the engine: the store turns it into a miss plus a
metric. These exceptions surface only at configuration time, in CLIs and in tools.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the offending field."""


class ModelError(KvtierError):
    """The embedded model could not be installed, converted or verified."""


class CodecError(KvtierError):
    """A stored block is malformed, truncated, from another namespace or another version."""


class ChecksumError(CodecError):
    """A stored block's payload does not match the checksum in its header."""


class TierError(KvtierError):
    """A storage tier failed an operation (I/O error, lost connection)."""


class RoutingError(KvtierError):
    """No healthy replica is left to take a request (all excluded, failed or unknown)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (or a hangup), raised where the command is so that its `finally` blocks and
    context managers stop the servers, mounts and namespaces it started (as Ctrl-C does)."""


def raise_terminated(signum: int, frame: object) -> None:
    """A signal handler raising `Terminated`."""
    raise Terminated


def run_every(steps: Iterable[Callable[[], object]]) -> None:
    """Call each of `steps` in order, each even when one before it raised (an interrupt
    included), then raise the first exception met: a stop that fails or is interrupted halfway
    still stops everything after it."""
    first: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
