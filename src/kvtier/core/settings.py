"""kvtier's settings model: every setting declared once, validated once, reachable everywhere.

A settings class is a frozen pydantic model (`Settings`) whose fields carry their type, bounds,
default and a docstring. Everything else derives from it:

- the vLLM connector's `kv_connector_extra_config` and the `KVTIER_*` environment
  (`kvtier.vllm.settings`),
- the deployment file of `kvtier up` (`kvtier.tools.cluster.spec`),
- command-line flags (`add_flags` / `from_flags`: `--l1-bytes 4GiB` for field `l1_bytes`),
- the docs' settings tables (`describe_fields`).

Units are stated once, by the field's name: `_bytes` fields take a byte count or a size with a
binary unit ("512MiB", "4G"), `_s` fields seconds, `_ms` fields milliseconds, `_mode` fields
file permissions (an octal string such as "0o640" in a document). A bad value or an unknown key
raises `ConfigError` naming the full key (`kvtier.connector.l1_bytes: ...`).

`StoreSettings` (one replica's `TieredStore`) lives here; the other layers declare theirs on top
of `Settings` next to the code they configure.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, Self, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo

from kvtier.core.errors import ConfigError

__all__ = [
    "L2_URL_SCHEMES",
    "AdmissionName",
    "ByteSize",
    "FileMode",
    "L2ProfileName",
    "Mode",
    "Settings",
    "StoreSettings",
    "add_flags",
    "describe_fields",
    "from_flags",
    "parse_bytes",
    "parse_mode",
    "redact_url",
    "to_flags",
]

_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*")


def parse_bytes(value: object) -> object:
    """A byte count from an int or a size string ("123", "512M", "10GiB", "1.5T": binary
    units); anything else is passed on for the field's own type check to reject."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None:
            raise ValueError(f"cannot read {value!r} as a size (e.g. 4096, 512MiB, 10G)")
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


ByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0)]
"""A number of bytes; accepts "4GiB"-style strings."""


class FileMode(int):
    """File permissions a settings model has read; shown as they are written ("0o640")."""

    def __repr__(self) -> str:
        return _octal(self)

    __str__ = __repr__


def _octal(mode: int) -> str:
    """`mode` as a document writes it: "0o640"."""
    return f"0o{mode:o}"


def parse_mode(value: object) -> object:
    """File permissions from an int or an octal string ("0o640", "640", "0640")."""
    if isinstance(value, str):
        try:
            return int(value.removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"cannot read {value!r} as octal permissions (e.g. 0o600)") from None
    return value


def _check_modes(cls: type[BaseModel], values: Mapping[str, Any], where: str) -> None:
    """Refuse a number for file permissions in a document: YAML and JSON read 400 as decimal
    (0o620), never what was meant. A `FileMode` came from a settings object: it stands."""
    for name, field in cls.model_fields.items():
        value = values.get(field.alias or name, values.get(name))
        if _is_mode(field) and isinstance(value, (int, float)) and not isinstance(value, FileMode):
            key = f"{where}.{name}" if where else name
            shown = f" ({_octal(value)})" if isinstance(value, int) and value >= 0 else ""
            raise ConfigError(
                f"{key}: {value!r} would read as decimal{shown}: write permissions as an octal "
                f'string such as "0o640"'
            )


def _is_mode(field: FieldInfo) -> bool:
    return any(getattr(m, "func", None) is parse_mode for m in field.metadata)


Mode = Annotated[
    int,
    BeforeValidator(parse_mode),
    Field(ge=0, le=0o777),
    AfterValidator(FileMode),
    PlainSerializer(_octal, return_type=str),
]
"""File permissions: an int in Python (`l2_file_mode=0o640`), an octal string ("0o640") in a
document (`from_mapping`); a dump (the extra config a replica is given) writes them so."""


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***` (for logs and errors)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


L2ProfileName = Literal["local", "juicefs", "curvine", "nfs", "efs"]
"""File systems an L2 directory may live on (`kvtier.core.tiers.profiles` has their numbers)."""

AdmissionName = Literal["always", "min-tokens", "reused"]
"""Admission policies of the store (`kvtier.core.admission`)."""

L2_URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")
"""URL schemes of a Valkey/Redis L2."""


class Settings(BaseModel):
    """Base of every settings class: frozen, unknown keys rejected, field docstrings kept."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        populate_by_name=True,
    )

    def __init__(self, **values: Any) -> None:
        """Keyword arguments only; a bad value raises `ConfigError` naming its key."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise config_error(type(self), exc) from None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, where: str = "") -> Self:
        """Validate `values` (a document's: file permissions are octal strings); a `ConfigError`
        names the full key, prefixed by `where`."""
        _check_modes(cls, values, where)
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            raise config_error(cls, exc, where) from None

    def replaced(self, **changes: Any) -> Self:
        """A copy with `changes` applied and validated again."""
        return type(self).from_mapping({**self.model_dump(), **changes})

    def non_default(self) -> dict[str, Any]:
        """The fields that differ from their defaults, as plain values."""
        return self.model_dump(exclude_defaults=True)


def config_error(cls: type[BaseModel], exc: ValidationError, where: str = "") -> ConfigError:
    """One readable error from pydantic's: the first problem, with its full key."""
    error = exc.errors(include_url=False)[0]
    loc = [str(p) for p in error["loc"]]
    message = str(error["msg"]).removeprefix("Value error, ")
    named = re.match(r"([\w.]+): (.*)", message, re.DOTALL)
    if named and error["type"] == "value_error":  # a check that names its key
        key = named.group(1)
        loc = key.split(".") if key.startswith(".".join(loc) + ".") else [*loc, key]
        message = named.group(2)
    key = ".".join(loc)
    full = f"{where}.{key}" if where and key else where or key or cls.__name__
    if error["type"] == "extra_forbidden":
        known = ", ".join(sorted(f.alias or name for name, f in _fields_at(cls, error["loc"])))
        return ConfigError(f"{full}: unknown setting (known: {known})")
    if error["type"] == "missing":
        return ConfigError(f"{full}: required")
    given = error.get("input")
    shown = (
        ""
        if isinstance(given, dict) or given is None or repr(given) in message
        else f", got {given!r}"
    )
    return ConfigError(f"{full}: {message[0].lower()}{message[1:]}{shown}")


def _fields_at(cls: type[BaseModel], loc: Sequence[int | str]) -> list[tuple[str, FieldInfo]]:
    """The fields of the model that holds the key at `loc` (for "known: ..." lists)."""
    model: type[BaseModel] = cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part)) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            break
        model = inner
    return list(model.model_fields.items())


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


# ----- the store ------------------------------------------------------------------------------


class StoreSettings(Settings):
    """One replica's `TieredStore`: L1 host memory and an optional shared L2.

        StoreSettings(l1_bytes="4GiB", l2_path="/mnt/shared/kvtier")
        StoreSettings(l2_path="/mnt/jfs/kvtier", l2_profile="juicefs", l2_capacity_bytes="500G")
        StoreSettings(l2_url="redis://10.0.0.5:6379/0")           # L2 on Valkey/Redis

    L2 is at most one of `l2_path` and `l2_url`. Capacity (`l2_capacity_bytes`, watermarks,
    janitor interval) applies to `l2_path` only: a Valkey server bounds itself (`maxmemory`).
    """

    l1_bytes: ByteSize = 2 * 1024**3
    """L1 host-memory budget (payload plus buffer overhead); 0 disables L1."""
    l2_path: Annotated[str, Field(min_length=1)] | None = None
    """Shared directory for L2 (a FUSE/NFS mount or a local directory); unset: no directory L2."""
    l2_url: str | None = None
    """Valkey/Redis server for L2 (redis://host:port[/db]; rediss:// for TLS), or any node of a
    cluster (cluster mode: database 0, keys spread over its shards); unset: no Valkey L2. Put no
    password in it (it shows in process listings): use `l2_password_file`."""
    l2_username: str | None = None
    """Valkey ACL user to authenticate as (with the password below); unset: the default user."""
    l2_password_file: str | None = None
    """File holding the Valkey password (AUTH); the password may also come from
    $KVTIER_L2_PASSWORD. Never logged."""
    l2_tls_ca_file: str | None = None
    """CA bundle (PEM) that signs the Valkey server's certificate (with a rediss:// URL); unset:
    the system's."""
    l2_file_mode: Mode = FileMode(0o600)
    """Permissions of the files `l2_path` holds, as an octal string: e.g. "0o640" to share with
    a group (a bare number is refused: YAML and JSON read 400 as decimal); directories get
    search permission where read is granted (0o700)."""
    l2_profile: L2ProfileName = "local"
    """File system under `l2_path`: sets the janitor's tolerance for stale attributes and
    whether evictions wait out a grace period (see docs/l2.md)."""
    l2_direct_reads: bool | None = None
    """Read `l2_path` block files with O_DIRECT (no kernel page cache); unset: the profile's
    choice (on for juicefs and curvine, off elsewhere)."""
    l2_capacity_bytes: ByteSize | None = None
    """Bytes the `l2_path` directory may hold, all replicas and models together; set, this
    replica may run the capacity janitor (one acts at a time cluster-wide: set the same value on
    every replica). Unset: no capacity enforcement from this replica."""
    l2_high_watermark: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of `l2_capacity_bytes` above which the janitor evicts."""
    l2_low_watermark: Annotated[float, Field(gt=0, le=1)] = 0.75
    """Fraction of `l2_capacity_bytes` an eviction brings usage down to (and an idle L2 is
    trimmed to)."""
    l2_janitor_interval_s: Annotated[float, Field(gt=0)] = 5.0
    """Seconds between janitor passes (a pass scans the whole directory)."""
    l2_touch_interval_s: Annotated[float, Field(ge=0)] = 60.0
    """A read hit refreshes the block's mtime (the shared recency the janitor evicts by) when it
    is older than this: hot blocks cost one metadata write per interval."""
    l2_exists_ttl_s: Annotated[float, Field(ge=0)] = 1.0
    """How long an L2 existence answer is reused by lookups and by saves (which skip writing a
    block confirmed in L2 this recently); 0 disables the reuse."""
    admission: AdmissionName = "always"
    """Which saved blocks the store keeps: always, min-tokens, reused."""
    admission_min_tokens: Annotated[int, Field(ge=0)] = 0
    """For "min-tokens": keep a block only if the prefix it ends is at least this many tokens."""
    write_queue_blocks: Annotated[int, Field(gt=0)] = 64
    """Capacity of the asynchronous L2 write queue in blocks; a full queue drops and counts."""
    io_threads: Annotated[int, Field(gt=0)] = 2
    """Threads writing to L2 in the background."""

    @model_validator(mode="after")
    def _check_l2(self) -> Self:
        if self.l2_url is not None:
            if not self.l2_url.startswith(L2_URL_SCHEMES):
                raise ValueError(
                    f"l2_url: expected redis://host:port[/db], got {redact_url(self.l2_url)!r}"
                )
            if self.l2_path is not None:
                raise ValueError("l2_url: set either l2_path or l2_url, not both")
            if self.l2_capacity_bytes is not None:
                raise ValueError(
                    "l2_capacity_bytes: applies to l2_path only; a Valkey L2 is "
                    "bounded by its server's maxmemory"
                )
        if self.l2_capacity_bytes == 0:
            raise ValueError("l2_capacity_bytes: must be positive or unset")
        if self.l2_low_watermark > self.l2_high_watermark:
            raise ValueError(
                f"l2_low_watermark: must not exceed l2_high_watermark "
                f"({self.l2_high_watermark}), got {self.l2_low_watermark}"
            )
        return self


# ----- flags and docs -------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _is_sequence(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (tuple, list):
        return True
    return any(_is_sequence(a) for a in get_args(annotation) if a is not type(None))


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type[Settings],
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    flags: Mapping[str, str] | None = None,
    metavars: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of `cls` (`--l2-path` for `l2_path`, or the name `flags` gives), its
    help from the field's docstring and default; a sequence field takes several values and may
    be repeated. Values stay strings until `from_flags` validates them."""
    skip = set(skip)
    names = list(only) if only is not None else [n for n in cls.model_fields if n not in skip]
    for name in names:
        field = cls.model_fields[name]
        default = field.get_default(call_default_factory=True)
        help_text = (field.description or "").replace("%", "%%")
        if default is not None and default != () and not _is_bool(field.annotation):
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
        if _is_bool(field.annotation):
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["help"] += f" (default: {'on' if default else 'off'})"
        elif _is_sequence(field.annotation):
            kwargs.update(action="extend", nargs="+")
        if metavars and name in metavars:
            kwargs["metavar"] = metavars[name]
        parser.add_argument((flags or {}).get(name, _flag(name)), **kwargs)


def from_flags(
    cls: type[Settings],
    args: argparse.Namespace,
    base: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> Any:
    """`cls` from the flags `add_flags` declared (those given override `base`); an error names
    the flag."""
    values = dict(base or {})
    for name, field in cls.model_fields.items():
        given = getattr(args, name, None)
        if given is not None:
            values[field.alias or name] = given
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        message = str(config_error(cls, exc))
        key = message.split(":", 1)[0].split(".")[0]
        if key in cls.model_fields:
            message = (flags or {}).get(key, _flag(key)) + message[len(key) :]
        raise ConfigError(message) from None


def to_flags(
    cls: type[Settings], values: Mapping[str, Any], flags: Mapping[str, str] | None = None
) -> list[str]:
    """The command-line arguments `add_flags` reads back as `values` (for child processes)."""
    args: list[str] = []
    for name, value in values.items():
        flag = (flags or {}).get(name, _flag(name))
        if _is_bool(cls.model_fields[name].annotation):
            args.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def describe_fields(cls: type[Settings]) -> list[tuple[str, str, str]]:
    """(key, default, description) of every field, for docs tables."""
    rows = []
    for name, field in cls.model_fields.items():
        rows.append(
            (
                field.alias or name,
                _shown_default(name, field),
                " ".join((field.description or "").split()),
            )
        )
    return rows


def _shown_default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    if default is None:
        return "unset"
    if name.endswith("_bytes") and isinstance(default, int) and default >= 1024:
        unit = next(u for u in ("T", "G", "M", "K", "") if default % _UNITS[u.lower()] == 0)
        return f"{default // _UNITS[unit.lower()]}{unit}iB"
    if isinstance(default, BaseModel):
        return "see below"
    return str(default)
