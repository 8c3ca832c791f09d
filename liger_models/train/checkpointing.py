"""Atomic training checkpoints and the state that makes a resumed run bit-identical.

Layout under ``<output_dir>/checkpoints``::

    step_000200/            one complete checkpoint
        <model files>       written by the caller (HF / Medusa format: usable as they are)
        trainer_state.pt    step, optimizer, LR scheduler, data position, every rank's RNG states, run arguments
        checkpoint_manifest.json   size and digest of every other file, written last
    latest                  the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, flushed to disk, and only then renamed to its final
name; ``latest`` is replaced the same way. A crash or exception mid-save therefore leaves the previous checkpoint and
``latest`` untouched (the partial directory is removed; after a hard kill it is ignored by :func:`find_latest`
and deleted by the next save or the next run's start). Every temporary is named by liger_models.atomic's scheme, the
one the model writer (hub.py) stages its own files under, so one sweep finds what any killed writer left.
Pruning (``keep_last``) renames a checkpoint out of the ``step_N`` names before deleting it, for the same reason.

The manifest catches what the renames cannot: a file damaged after the checkpoint was published (a disk or copy
error, a truncation, a flipped bit). :func:`find_resumable` checks it and passes over a damaged checkpoint to the
newest intact one before it, saying which file is wrong and how. A checkpoint written before manifests existed has
none, and is taken unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from liger_models import atomic
from liger_models.hub import CHECKPOINT_POINTER, pointed_checkpoint

STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "checkpoint_manifest.json"
MANIFEST_FORMAT = 2
_BLOCK = 1 << 20  # bytes read at a time when hashing
# A manifest digest is SHA-256 over the SHA-256 digests of a file's consecutive PIECE_BYTES pieces, so that one large
# file (an 8B run's optimizer state is 64 GB) hashes on every core: SHA-256 runs at about 1.5 GB/s per core, so
# hashing it whole took ~45 s on one.
PIECE_BYTES = 64 << 20
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict:
    """Every RNG a training step may draw from (Python, torch CPU, and the current CUDA device)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_tree(root: Path) -> None:
    # Data must be on disk before the rename publishes it; otherwise a power loss can publish empty files.
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (its directory entry on disk), where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file in the same directory, fsync, rename)."""
    tmp = atomic.temp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    write_model: Callable[[Path, Path], None],
    trainer_state: dict,
    keep_last: int | None = None,
) -> Path:
    """Write a complete checkpoint for ``step`` atomically and return its directory.

    ``write_model(tmp_dir, final_dir)`` writes the model files into tmp_dir, which becomes final_dir once complete
    (a file that records its own location, such as a Medusa stage-2 config.json, names final_dir);
    ``trainer_state`` is saved with ``torch.save``, then the manifest of every file. With ``keep_last``, keeps the newest ``keep_last`` checkpoints
    up to this step (this one always; later steps, left by a run this one resumed before, are not pruned).
    Call on one process (rank 0) with already-gathered state.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _finish_interrupted(root)
    _drop_temporaries(root)
    final = root / step_dir_name(step)
    tmp = atomic.temp_path(final)
    tmp.mkdir()
    try:
        write_model(tmp, final)
        # Through a Python file object, not a path: torch's own writer reports a full disk as "unexpected pos"
        # with no errno; through the file object, the OSError (ENOSPC) is kept as the exception's context.
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save({**trainer_state, "step": step}, f)
        write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): swap, then drop the old copy
            old = atomic.temp_path(final, "old")
            os.rename(final, old)
            os.rename(tmp, final)
            atomic.discard(old)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomic(root / CHECKPOINT_POINTER, final.name + "\n")
    if keep_last:
        up_to_here = [p for p in list_checkpoints(root) if _step_of(p) <= step]
        for old in up_to_here[:-keep_last]:
            _remove(old)
    return final


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint so that no crash leaves it half there: renamed out of the step_N names first (a process
    killed inside rmtree leaves a ``pruned`` temporary, which the next save deletes, never a step_N that lists as
    complete with files missing)."""
    atomic.discard(checkpoint)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _finish_interrupted(root: Path) -> None:
    """Finish what a killed process left half done. Killed between a re-save's two renames, it leaves the previous
    copy as an ``old`` temporary and no ``step_N``: put it back, so the step is not lost (the new copy, still a
    ``tmp``, is incomplete by definition). Killed after them, it leaves the old copy beside the new ``step_N``
    (whole: it is renamed to a ``pruned`` name before its deletion starts): delete it. Killed mid-prune, it leaves a
    ``pruned`` directory (:func:`_remove`): finish deleting it. Only what a writer that is gone left is touched."""
    atomic.sweep(root, kinds=("old", "pruned"))


def _drop_temporaries(root: Path) -> None:
    """Delete what saves killed before their rename left (checkpoint directories, the model writer's own staging
    beside them, ``latest``): incomplete by definition, and each may be as large as a checkpoint. Only what a
    writer that is gone left (atomic.writer_gone): a save in flight in another process keeps its files."""
    atomic.sweep(root)


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (``latest`` if valid, else the highest step), or None."""
    root = Path(root)
    if root.is_dir():
        _finish_interrupted(root)
    candidate = pointed_checkpoint(root)
    if candidate is not None and (candidate / STATE_FILE).is_file():
        return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path:
    """``--resume auto`` → newest checkpoint of this run; else a checkpoint directory, a checkpoints root, or an
    earlier run's output directory (its newest checkpoint). Intact ones only: :func:`find_resumable`."""
    found = find_resumable(resume, output_dir)
    if found.checkpoint is None:
        raise FileNotFoundError(_none_under(resume, Path(output_dir) / "checkpoints"))
    return found.checkpoint


def _none_under(resume: str, target: Path) -> str:
    return f"--resume {resume}: no complete checkpoint (with {STATE_FILE}) under {target}"


def load_trainer_state(ckpt_dir: str | os.PathLike, mmap: bool = False) -> dict:
    """The ``trainer_state.pt`` of a checkpoint directory (``mmap``: tensors mapped from the file, not read: for a
    look at its small entries)."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"not a checkpoint: {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (EOFError, RuntimeError, ValueError, OSError) as exc:  # torch's reader names neither file nor cause
        raise ValueError(f"{path} is unreadable ({path.stat().st_size} bytes; damaged or cut short?): "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


# --------------------------------------------------------------------------------------------- the manifest


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read a block at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _piece_digest(path: Path, offset: int, length: int) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0 and (block := f.read(min(_BLOCK * 8, length))):
            digest.update(block)
            length -= len(block)
    return digest.digest()


def pieces_sha256_all(files: list[Path], piece_bytes: int | None = None) -> list[str]:
    """Each file's manifest digest: SHA-256 over the SHA-256 digests of its consecutive ``piece_bytes`` pieces (an
    empty file has one empty piece). Every piece of every file is one task on a thread pool as wide as the machine
    (hashlib releases the GIL on large updates). ``piece_bytes`` defaults to PIECE_BYTES."""
    piece_bytes = piece_bytes or PIECE_BYTES
    sizes = [f.stat().st_size for f in files]
    tasks = [(i, offset, min(piece_bytes, size - offset))
             for i, size in enumerate(sizes) for offset in range(0, max(size, 1), piece_bytes)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(tasks), os.cpu_count() or 1))) as pool:
        pieces = list(pool.map(lambda t: _piece_digest(files[t[0]], t[1], t[2]), tasks))
    combined = [hashlib.sha256() for _ in files]
    for (i, _, _), piece in zip(tasks, pieces):
        combined[i].update(piece)
    return [d.hexdigest() for d in combined]


def write_manifest(directory: Path) -> None:
    """Record the size and digest (``pieces_sha256_all``) of every file under ``directory`` in its manifest (written
    atomically)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "pieces_sha256": h}
               for p, h in zip(files, pieces_sha256_all(files))}
    text = json.dumps({"format": MANIFEST_FORMAT, "piece_bytes": PIECE_BYTES, "files": entries}, indent=1,
                      sort_keys=True) + "\n"
    write_text_atomic(directory / MANIFEST_FILE, text)


def has_manifest(checkpoint: str | os.PathLike) -> bool:
    return (Path(checkpoint) / MANIFEST_FILE).is_file()


def _read_manifest(checkpoint: Path) -> tuple[dict[str, dict], int | None]:
    """The manifest's {relative path: {"size", digest}} and its piece size (None: a format-1 manifest, whose
    "sha256" is the whole file's); ValueError when it is not one."""
    try:
        raw = json.loads((checkpoint / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{MANIFEST_FILE} is unreadable ({exc})") from exc
    files = raw.get("files") if isinstance(raw, dict) else None
    piece_bytes = raw.get("piece_bytes") if isinstance(raw, dict) and raw.get("format") == 2 else None
    key = "sha256" if piece_bytes is None else "pieces_sha256"
    if (not isinstance(files, dict) or STATE_FILE not in files
            or (piece_bytes is not None and not (isinstance(piece_bytes, int) and piece_bytes > 0))
            or not all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get(key), str)
                       for e in files.values())):
        raise ValueError(f"{MANIFEST_FILE} is not a manifest of this checkpoint's files")
    return files, piece_bytes


def damage(checkpoint: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint's files, by its manifest ("trainer_state.pt is 0 bytes, its manifest says
    1234"), or None when they all match it. A checkpoint without a manifest (written before they existed) has only
    its trainer_state.pt looked for: :func:`has_manifest` tells the two apart."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / MANIFEST_FILE).is_file():
        return None if (checkpoint / STATE_FILE).is_file() else f"{STATE_FILE} is missing"
    try:
        files, piece_bytes = _read_manifest(checkpoint)
    except ValueError as exc:
        return str(exc)
    for name, entry in files.items():  # sizes first: a missing or cut file is told without hashing anything
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} is {path.stat().st_size} bytes, its manifest says {entry['size']}"
    names = sorted(files)
    paths = [checkpoint / n for n in names]
    if piece_bytes is None:
        with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
            digests, key = list(pool.map(file_sha256, paths)), "sha256"
    else:
        digests, key = pieces_sha256_all(paths, piece_bytes), "pieces_sha256"
    for name, digest in zip(names, digests):
        if digest != files[name][key]:
            return f"{name}'s SHA-256 differs from its manifest's (its bytes changed)"
    return None


class Resumable(NamedTuple):
    """The checkpoint a resume starts from (None: none to start from), the damaged ones passed over on the way
    (newest first, each with what is wrong), and whether it was verified (False: it has no manifest)."""

    checkpoint: Path | None
    damaged: list[tuple[Path, str]]
    verified: bool


def _candidates(root: Path) -> list[Path]:
    """Where a resume may start, in order: the checkpoint ``latest`` names, then the complete ones before it, newest
    first (without a valid ``latest``: every complete one, newest first). Steps after the one ``latest`` names were
    left by a run that a later one went back on (it resumed from before them): not where this run stands."""
    complete = list_checkpoints(root)
    named = pointed_checkpoint(root)
    if named is None or not _STEP_DIR.match(named.name):
        return complete[::-1]
    return [named, *[p for p in complete[::-1] if _step_of(p) < _step_of(named)]]


def newest_intact(root: str | os.PathLike) -> Resumable:
    """The newest checkpoint under ``root`` whose files match its manifest (:func:`_candidates`' order)."""
    root = Path(root)
    if root.is_dir():
        _finish_interrupted(root)
    damaged = []
    for candidate in _candidates(root) if root.is_dir() else []:
        problem = damage(candidate)
        if problem is None:
            return Resumable(candidate, damaged, has_manifest(candidate))
        damaged.append((candidate, problem))
    return Resumable(None, damaged, False)


def find_resumable(resume: str, output_dir: str | os.PathLike) -> Resumable:
    """:func:`resolve_resume`, with each candidate checked against its manifest. ``--resume auto`` or a run's
    directory: the newest intact checkpoint (None for ``auto`` with no checkpoint yet); a checkpoint directory
    named outright: that one, or a ValueError saying what is damaged."""
    target = Path(output_dir) / "checkpoints" if resume == "auto" else Path(resume)
    if (target / STATE_FILE).is_file() or (target / MANIFEST_FILE).is_file():
        problem = damage(target)
        if problem is not None:
            raise ValueError(f"--resume {resume}: checkpoint {target} is damaged: {problem}")
        return Resumable(target, [], has_manifest(target))
    if not list_checkpoints(target) and (target / "checkpoints").is_dir():
        target = target / "checkpoints"
    found = newest_intact(target)
    if found.checkpoint is None and found.damaged:
        what = "; ".join(f"{path.name}: {why}" for path, why in found.damaged)
        raise ValueError(f"--resume {resume}: no intact checkpoint under {target} ({what})")
    if found.checkpoint is None and resume != "auto":
        raise FileNotFoundError(_none_under(resume, target))
    return found
