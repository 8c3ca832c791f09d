"""A full disk (or an exhausted quota) while a run writes, said in one line instead of a writer's traceback.

Writers report it in their own words: Python's ``OSError`` with errno ENOSPC / EDQUOT, safetensors' "I/O error: No
space left on device (os error 28)", torch's "unexpected pos ..." (whose cause, with a Python file object to write
to, is the OSError: checkpointing.py saves through one). :func:`reported` turns any of them into :class:`DiskFull`,
whose message names what was being written, where, the space left there, and the last checkpoint, which is intact:
checkpoints and the logs a resume rewrites are written under temporary names and renamed into place
(checkpointing.py, liger_models.atomic), and a failed write deletes its temporary on the way out.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# How the writers that do not raise an OSError word the same errors (safetensors' Rust I/O errors, C++ streams).
_WORDS = {errno.ENOSPC: ("No space left on device", "os error 28"),
          errno.EDQUOT: ("Disk quota exceeded", "os error 122")}


class DiskFull(OSError):
    """A write failed for want of space (:attr:`errno`: ENOSPC or EDQUOT); the message says what, where and what
    is left intact."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.errno = code


def full_disk_errno(exc: BaseException | None) -> int | None:
    """ENOSPC / EDQUOT when ``exc``, or an exception it was raised from or while handling, is a full disk."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in REASONS:
            return exc.errno
        text = str(exc)
        for code, words in _WORDS.items():
            if any(w in text for w in words):
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def _size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def _free(path: Path) -> str:
    """The space left on the filesystem that holds ``path`` (its nearest existing ancestor), in words."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"{_size(shutil.disk_usage(path).free)} free"
    except OSError:
        return "free space unknown"


def message(code: int, what: str, path: Path, last_checkpoint: Path | None) -> str:
    """The one line :class:`DiskFull` carries."""
    kept = (f"the last checkpoint, {last_checkpoint}, is intact" if last_checkpoint is not None
            else "no checkpoint had been written yet")
    return (f"disk full ({REASONS[code]}) writing {what} {path} ({_free(path)} there); {kept}: free some space, "
            "then continue with --resume auto")


@contextlib.contextmanager
def reported(what: str, path: str | os.PathLike, last_checkpoint) -> Iterator[None]:
    """Within the block, a full-disk error becomes :class:`DiskFull` (module docstring). ``last_checkpoint()``
    gives the checkpoint that remains, asked only once the write has failed."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        code = full_disk_errno(exc)
        if code is None:
            raise
        raise DiskFull(message(code, what, Path(path), last_checkpoint()), code) from exc
