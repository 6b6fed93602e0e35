"""The overlay's directory (`--out`): claimed, replaced whole, its generated secrets kept.

`render` writes into the directory `replacing` yields, inside `--out`; only once the overlay is
whole does it replace an earlier render's (`OVERLAY`), so a render that fails leaves `--out` as
it was. `--out` must be new, empty, or an earlier render's (its kustomization.yaml starts with
`HEADER`): the user's files are never overwritten. `secret` makes a random secret once, in
`--out`/`SECRETS`; a later render keeps it. Errors are `ConfigError`s naming --out.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvtier.core.errors import ConfigError

__all__ = ["HEADER", "replacing", "secret"]

HEADER = "# Written by `kvtier deploy render`; apply with: kubectl apply -k .\n"
"""The first line of a rendered kustomization.yaml: marks a directory `render` may rewrite."""
OVERLAY = ("base", "components", "patches", "kustomization.yaml")
"""What `render` writes into --out and replaces there (secrets/ is kept, other files left)."""
SECRETS = "secrets"
"""Where --out keeps the generated secrets: a render adds the ones it lacks, never replaces."""


@contextlib.contextmanager
def replacing(out: Path) -> Iterator[Path]:
    """A new directory in `out` to write the overlay (and new secrets) into; once it is
    written, the new secrets join `out`'s, its entries replace those of `out` (an earlier
    render's) and it is removed. Until then `out` is left as it was, so a render that fails
    loses nothing and leaves nothing (an `out` it made is removed again: a later render must
    not find it non-empty). An `OSError` is a `ConfigError` naming --out."""
    made = not out.exists()
    try:
        _claim_out_dir(out)
        build = Path(tempfile.mkdtemp(prefix=".render.", dir=out))
        try:
            yield build
            if (build / SECRETS).is_dir():
                (out / SECRETS).mkdir(mode=0o700, exist_ok=True)
                for secret in (build / SECRETS).iterdir():
                    secret.rename(out / SECRETS / secret.name)
            old = build / "old"
            old.mkdir()
            for name in OVERLAY:  # kustomization.yaml last: the overlay is whole once it is
                with contextlib.suppress(FileNotFoundError):
                    (out / name).rename(old / name)
                (build / name).rename(out / name)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    except BaseException as exc:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        if isinstance(exc, OSError):
            raise ConfigError(f"--out {out}: {exc.strerror or exc}") from None
        raise


def _claim_out_dir(out: Path) -> None:
    """Make `out`; a `ConfigError` if it is a file, or a non-empty directory whose
    kustomization.yaml `render` did not write (re-rendering would overwrite the user's files)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: not a directory")
    if out.is_dir() and any(out.iterdir()) and not _written_by_render(out):
        raise ConfigError(
            f"--out {out}: a non-empty directory `kvtier deploy render` did not write; "
            "give a new or empty one"
        )
    out.mkdir(parents=True, exist_ok=True)


def _written_by_render(out: Path) -> bool:
    try:
        return (out / "kustomization.yaml").read_bytes().startswith(HEADER.encode())
    except OSError:
        return False


def secret(out: Path, build: Path, name: str, kind: str) -> str:
    """A random secret kept in out/secrets (made once, in `build` until the overlay is whole;
    re-rendering keeps it)."""
    if not (out / SECRETS / name).exists():
        path = build / SECRETS / name
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(24) + ("\n" if kind == "key" else ""))
    return f"{SECRETS}/{name}"
