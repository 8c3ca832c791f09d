"""One run at a time per output directory, and no temporaries left there by the runs before it.

:func:`claimed` holds an exclusive ``flock`` on ``<output_dir>/.liger-run.lock`` for the whole run. The kernel drops
the lock when its holder's process ends, however it ends, so a lock left by a killed run is simply taken over; the
file itself is never deleted (a run that deleted it while another opened it would let a third lock a new file
while the second still held the old one). A second run into the directory is refused with the holder's pid and
start time, which the holder writes into the lock file. Under torchrun only rank 0 takes the lock, on behalf of the
run (every rank reads the directory, but only rank 0 writes checkpoints and logs); the others wait for its verdict
and fail with the same error when it is refused, before any of them touches the directory.

Once the lock is held, rank 0 clears what killed writers left (liger_models.atomic's temporaries: checkpoint and
model-file staging, rewritten logs, data-cache files): in the output directory and its checkpoints, everything
whose writer is gone or that is older than the lock; in the data cache (which other runs may share) only what
writers known to be dead left. The same sweep runs when the run ends, however it ends short of being killed.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Iterator

from liger_models import atomic
from liger_models.train import distributed as D

LOCK_FILE = ".liger-run.lock"


class RunDirectoryInUse(FileExistsError):
    """Another live run holds the output directory's lock."""


class RunLock:
    """An exclusive flock on ``<directory>/.liger-run.lock``; :attr:`since` is when it was taken (None: not held,
    or the filesystem cannot lock)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.since: float | None = None
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirectoryInUse` naming the run that holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise RunDirectoryInUse(f"{self.directory} is in use by another run ({holder}); wait for it to end or "
                                    "stop it, or choose another --output-dir") from None
        except OSError as exc:  # a filesystem without locks (some NFS mounts): run, but say what is not guarded
            os.close(fd)
            warnings.warn(f"cannot lock {self.path} ({exc}): a second run started into {self.directory} would not "
                          "be refused", stacklevel=2)
            return
        self._fd, self.since = fd, time.time()
        _write_holder(fd, self.since)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd, self.since = None, None


def _write_holder(fd: int, since: float) -> None:
    # In place, not by rename: the lock belongs to this inode, which a rename would replace.
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.fromtimestamp(since).astimezone().isoformat(timespec="seconds")}
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _describe_holder(fd: int) -> str:
    """"pid N, started at T" (with the host when it is another one) from the holder's record, as far as it is
    readable (the holder may not have written it yet)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        record = {}
    if not isinstance(record, dict) or "pid" not in record:
        return "its pid not recorded yet"
    host = record.get("host")
    where = f" on {host}" if host and host != socket.gethostname() else ""
    return f"pid {record['pid']}{where}, started at {record.get('started', '?')}"


def sweep_leftovers(output_dir: Path, cache_dir: Path | None, locked_since: float | None) -> list[Path]:
    """Clear the temporaries killed writers left (module docstring); returns what was cleared."""
    cleared = []
    for directory in (output_dir, output_dir / "checkpoints"):
        cleared += atomic.sweep(directory, locked_since=locked_since)
    if cache_dir is not None:
        inside = cache_dir.resolve().is_relative_to(output_dir.resolve())
        cleared += atomic.sweep(cache_dir, locked_since=locked_since if inside else None)
    return cleared


@contextlib.contextmanager
def claimed(output_dir: str | os.PathLike, info: D.DistInfo, cache_dir: str | os.PathLike | None = None
            ) -> Iterator[RunLock]:
    """Hold ``output_dir`` for one run (module docstring): collective under torchrun, every rank enters it."""
    output_dir = Path(output_dir)
    cache = Path(cache_dir) if cache_dir is not None else None
    lock = RunLock(output_dir)
    failure = None
    if info.is_main:
        try:
            lock.acquire()
            sweep_leftovers(output_dir, cache, lock.since)
        except Exception as exc:  # every rank raises it: the others would otherwise wait for rank 0 forever
            lock.release()
            failure = exc
    failure = D.broadcast_object(failure)
    if failure is not None:
        raise failure
    try:
        yield lock
    finally:
        if info.is_main:
            try:
                sweep_leftovers(output_dir, cache, None)
            finally:
                lock.release()
