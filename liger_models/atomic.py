"""One naming scheme for every temporary the package writes, and the sweep that clears those a dead writer left.

Whatever is written under a temporary name and then renamed into place (a checkpoint, a model directory, a
data-cache file, a rewritten log) is named, beside its target::

    .<target name>.<host>-<pid>-<random>.liger-<kind>

kind ``tmp``: being written; ``old``: a previous copy swapped out of the target's name, deleted once the new copy is
in place; ``pruned``: being deleted (renamed first, so that a process killed halfway through a deletion never
leaves a half-deleted directory under a name that is trusted). <host> (a hash of the host name) and <pid> name the
writer, so that :func:`sweep` can tell what a killed writer left (a SIGKILL, an OOM kill, a node lost mid-save:
each may leave a whole model copy) from a write still in progress in another process. Only names of this form are
ever swept, and nothing else in the package writes one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

KINDS = ("tmp", "old", "pruned")
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_STAGED = re.compile(r"^\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}"
                     r"\.liger-(?P<kind>tmp|old|pruned)$")
# /proc gives a start time in clock ticks since boot and a boot time in whole seconds: allow for that rounding.
_START_SLACK_S = 1.5


class Staged(NamedTuple):
    """A temporary of the scheme: where it is, the target it stands for, its kind and its writer."""

    path: Path
    target: Path
    kind: str
    host: str
    pid: int


def temp_path(target: str | os.PathLike, kind: str = "tmp") -> Path:
    """A fresh name of the scheme beside ``target`` for this process (nothing is created)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    target = Path(target)
    return target.with_name(f".{target.name}.{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}.liger-{kind}")


def parse(path: str | os.PathLike) -> Staged | None:
    """What a name of the scheme stands for, or None for any other name."""
    path = Path(path)
    m = _STAGED.match(path.name)
    if m is None:
        return None
    return Staged(path, path.with_name(m["target"]), m["kind"], m["host"], int(m["pid"]))


def staged_in(directory: str | os.PathLike, target: str | None = None) -> list[Staged]:
    """The temporaries of the scheme directly in ``directory`` (only those standing for ``target``, if given)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    prefix = f".{target}." if target is not None else "."
    found = (parse(Path(directory) / name) for name in names if name.startswith(prefix))
    return sorted((s for s in found if s is not None and (target is None or s.target.name == target)),
                  key=lambda s: s.path.name)


def remove(path: str | os.PathLike) -> None:
    """Delete a file or a directory tree, whichever ``path`` is (gone already is fine)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def discard(path: str | os.PathLike) -> None:
    """Delete ``path`` by first renaming it to a ``pruned`` name: a process killed inside the deletion leaves a
    temporary that the next sweep finishes, never a half-deleted checkpoint under its own (or an ``old``) name."""
    path = Path(path)
    staged = parse(path)
    doomed = temp_path(staged.target if staged is not None else path, "pruned")
    os.rename(path, doomed)
    remove(doomed)


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), where /proc says; None where it cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _writer_alive(staged: Staged, mtime: float) -> bool:
    """Whether the process that wrote ``staged`` (on this host) may still be writing it. A pid is reused once its
    process is gone: a process that started after the temporary was last modified cannot be its writer."""
    try:
        os.kill(staged.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    started = _process_start(staged.pid)
    return started is None or started <= mtime + _START_SLACK_S


def writer_gone(staged: Staged, locked_since: float | None = None) -> bool:
    """Whether nobody can be writing ``staged`` any more.

    This process: yes (sweeps are made while this process has no write of its own in flight). Another process on
    this host: when it is dead (or its pid now belongs to a younger process). A process on another host cannot be
    asked: only in a directory whose run lock this process has held since ``locked_since`` (run_dir.py), where the
    only other writers are this run's own processes, is a temporary older than the lock known to be a leftover."""
    try:
        mtime = os.lstat(staged.path).st_mtime
    except FileNotFoundError:
        return False  # swept meanwhile by another process: nothing to do
    if staged.host == HOST:
        return staged.pid == os.getpid() or not _writer_alive(staged, mtime)
    return locked_since is not None and mtime < locked_since


def sweep(directory: str | os.PathLike, *, target: str | None = None, locked_since: float | None = None,
          kinds: tuple[str, ...] = KINDS) -> list[Path]:
    """Clear what writers that are gone (:func:`writer_gone`) left in ``directory`` (for ``target`` only, if given)
    and return the paths cleared. A ``tmp`` or ``pruned`` leftover is deleted; an ``old`` one is the previous copy
    of a swap cut short: put back when its target is missing (killed between the swap's two renames), else deleted
    (the new copy is in place)."""
    cleared = []
    for staged in staged_in(directory, target):
        if staged.kind not in kinds or not writer_gone(staged, locked_since):
            continue
        if staged.kind == "old" and not os.path.lexists(staged.target) and parse(staged.target) is None:
            _put_back(staged)
        else:
            remove(staged.path)
        cleared.append(staged.path)
    return cleared


def _put_back(staged: Staged) -> None:
    try:
        os.rename(staged.path, staged.target)
    except OSError:  # every rank of a run may sweep at startup: another one may have put it back first
        if not os.path.lexists(staged.target):
            raise


def write_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, then rename it over ``path``: a reader finds
    the old file or the whole new one, never a part."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    sweep(directory, target=os.path.basename(path))  # what writes of this file killed midway left
    tmp = str(temp_path(os.path.join(directory, os.path.basename(path))))
    try:
        # The file ends with the mode a plain write gives it (the umask's): mkstemp, and safetensors' own save, make
        # it owner-only (0600), which the rename keeps, and the checkpoint was unreadable to any other account (a
        # TGI / vLLM server's user, a teammate).
        with open(tmp, "x"):
            mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """``write_file`` for a UTF-8 text file."""
    write_file(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
