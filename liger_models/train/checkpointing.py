"""Atomic training checkpoints and the state that makes a resumed run bit-identical.

Layout under ``<output_dir>/checkpoints``::

    step_000200/            one complete checkpoint
        <model files>       written by the caller (HF / Medusa format: usable as they are)
        trainer_state.pt    step, optimizer, LR scheduler, data position, every rank's RNG states, run arguments
    latest                  the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, flushed to disk, and only then renamed to its final
name; ``latest`` is replaced the same way. A crash or exception mid-save therefore leaves the previous checkpoint and
``latest`` untouched (the partial directory is removed; after a hard kill it is ignored by :func:`find_latest`
and deleted by the next save or the next run's start). Every temporary is named by liger_models.atomic's scheme, the
one the model writer (hub.py) stages its own files under, so one sweep finds what any killed writer left.
Pruning (``keep_last``) renames a checkpoint out of the ``step_N`` names before deleting it, for the same reason.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from liger_models import atomic

STATE_FILE = "trainer_state.pt"
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
    ``trainer_state`` is saved with ``torch.save``. With ``keep_last``, keeps the newest ``keep_last`` checkpoints
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
        torch.save({**trainer_state, "step": step}, tmp / STATE_FILE)
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
    write_text_atomic(root / "latest", final.name + "\n")
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
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text(encoding="utf-8").strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path:
    """``--resume auto`` → newest checkpoint of this run; else a checkpoint directory, a checkpoints root, or an
    earlier run's output directory (its newest checkpoint)."""
    target = Path(output_dir) / "checkpoints" if resume == "auto" else Path(resume)
    if (target / STATE_FILE).is_file():
        return target
    if not list_checkpoints(target) and (target / "checkpoints").is_dir():
        target = target / "checkpoints"
    latest = find_latest(target)
    if latest is None:
        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint (with {STATE_FILE}) under {target}")
    return latest


def load_trainer_state(ckpt_dir: str | os.PathLike) -> dict:
    """The ``trainer_state.pt`` of a checkpoint directory."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"not a checkpoint: {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=True)
