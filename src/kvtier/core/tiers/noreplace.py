"""`rename_noreplace`: rename a file only if the target name is free, in one system call.

Linux's `renameat2(..., RENAME_NOREPLACE)` (glibc 2.28+, called through ctypes: Python's
`os.rename` has no flags) publishes a finished temp file under its final name atomically and
only if absent, the same guarantee as `link` + `unlink` of the temp name in one metadata
operation instead of two (on a FUSE file system each is a round trip to its daemon and often to
a metadata server). Supported by ext4, xfs, btrfs, tmpfs and FUSE file systems that implement
it (JuiceFS checks it inside its metadata transaction); others answer EINVAL, which callers
treat as "use link instead". The kernel itself refuses the rename when the target name is in
its view, so a FUSE daemon that drops the flag (mfusepy's does; kvtier's faultfs passes it on)
could only replace a block another node published in the same instant, with identical bytes.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

__all__ = ["RENAME_NOREPLACE", "UNSUPPORTED", "rename_noreplace"]

UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP})
"""Errors meaning "this system or file system cannot rename without replacing"."""
_AT_FDCWD = -100
RENAME_NOREPLACE = 1
"""renameat2's flag: fail with EEXIST rather than replace the target."""


def _load() -> Callable[..., int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc 2.28+, or not Linux
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_renameat2 = _load()


def rename_noreplace(src: str, dst: str) -> None:
    """Rename `src` to `dst` unless `dst` exists. Raises FileExistsError if it does, and an
    OSError with an errno in `UNSUPPORTED` where the system or file system cannot do this."""
    if _renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", dst)
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), RENAME_NOREPLACE):
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise FileExistsError(code, os.strerror(code), dst)
        raise OSError(code, os.strerror(code), dst)
