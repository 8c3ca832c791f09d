"""What defines a training run, recorded in each of its checkpoints, and the check that a resume continues that run.

A run is its model (``--model`` as given, resolved: an absolute path or a Hub id; and a digest of its weights), its
tokenizer files, its data (each ``--data`` file's SHA-256, the digests the data cache keys on) and every option that
changes the math of a step: the learning-rate schedule, the optimizer (``--optimizer``) and its settings, the global
batch (``--batch-size`` × processes) and ``--grad-accum``, ``--seq-len`` and the chat template, the dtype, the seed,
the approximate loss, and Medusa's loss and learning-rate options. A resume whose settings differ from its
checkpoint's is refused, each difference named (old → new); ``--allow-changed-settings NAME,...`` (or ``all``) lets
named ones through, which is printed and logged with the first resumed step's metrics, and the checkpoints after it
record the new values (another ``--optimizer`` starts its state from zero: the saved one is another optimizer's).

Free to change: ``--max-steps`` (a finished run is extended along the longer schedule), the number of processes at
the same global batch (W ranks × B windows is one process × B·W, sample for sample: batches.py's BatchStream), options
that change memory or speed and not the math (``--activation-checkpointing``, ``--optimizer-in-backward``,
``--cuda-graph``, ``--adamw``, ``--loss-scratch-mib``), and logging, evaluation and checkpointing options.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from liger_models.hub import checkpoint_files, tokenizer_files
from liger_models.train.checkpointing import file_sha256
from liger_models.train.data_cache import file_digest

SAMPLE = 4096  # bytes of a tensor hashed at each of its start, middle and end
# Every name a resume checks, in the order differences are listed; each is the option's name (model-weights and
# tokenizer: --model's weights and tokenizer files; batch-size: --batch-size × processes, the global batch).
COMMON = ("model", "model-weights", "tokenizer", "data", "seq-len", "chat-template", "batch-size", "grad-accum",
          "lr", "warmup-steps", "min-lr-ratio", "weight-decay", "beta1", "beta2", "adam-eps", "max-grad-norm", "dtype",
          "seed", "loss-grad-filter-eps", "optimizer", "lora")
MEDUSA = ("init-heads", "head-lr-multiplier", "schedule", "lambda0", "decay", "base-loss-weight")
ALWAYS_ALLOWED = ("max-steps",)
# Settings checkpoints record since a later version, and the value a checkpoint that does not record one ran with.
RECORDED_SINCE = {"optimizer": "adamw", "adam-eps": 1e-8}
_HEX = re.compile(r"[0-9a-f]{64}")


class Change(NamedTuple):
    name: str
    old: Any
    new: Any


# --------------------------------------------------------------------------------------------- what a run is


def weights_digest(model_dir: Path) -> str:
    """SHA-256 over each safetensors file's size and header (tensor names, dtypes, shapes, offsets) and SAMPLE bytes
    at each tensor's start, middle and end. Weights that differ anywhere but in a few isolated bytes differ in those
    samples; a 1B model read cold from disk takes 30 ms this way (every byte: 4 s; loading it: 5 s)."""
    digest = hashlib.sha256()
    for file in checkpoint_files(model_dir):
        try:
            _sample_file(file, digest)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{file} is not a readable safetensors file ({exc})") from exc
    return digest.hexdigest()


def _sample_file(file: Path, digest) -> None:
    with open(file, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little")
        if len(raw) != 8 or not 2 <= length <= min(100 << 20, file.stat().st_size - 8):
            raise ValueError(f"header length {length}")
        header = f.read(length)
        digest.update(file.stat().st_size.to_bytes(8, "little") + header)
        entries = json.loads(header)
        entries.pop("__metadata__", None)
        for entry in sorted(entries.values(), key=lambda e: e["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            for offset in sorted({begin, max(begin, (begin + end - SAMPLE) // 2), max(begin, end - SAMPLE)}):
                f.seek(8 + length + offset)
                digest.update(f.read(min(SAMPLE, end - offset)))


def tokenizer_digests(model_dir: Path) -> dict[str, str]:
    """{file: SHA-256} of --model's tokenizer files (tokenizer, special tokens, chat templates:
    hub.TOKENIZER_PATTERNS)."""
    return {name: file_sha256(model_dir / name) for name in tokenizer_files(model_dir)}


def collect(*, model: str, model_dir: Path, data: Sequence[str | os.PathLike],
            options: dict[str, Any]) -> dict[str, Any]:
    """This run's settings (module docstring): ``model`` is --model resolved, ``options`` the recipe's other
    settings by their names here (recipes/configs.py: ``resume_settings``), dtype and peak LR resolved."""
    return {"model": model, "model-weights": weights_digest(model_dir), "tokenizer": tokenizer_digests(model_dir),
            "data": [file_digest(path) for path in data], **options}


# --------------------------------------------------------------------------------------------- the check


def parse_allowed(text: str | None) -> set[str]:
    """The names ``--allow-changed-settings`` gives (comma-separated; ``all``); ValueError for an unknown one."""
    names = {name.strip() for name in (text or "").split(",") if name.strip()}
    unknown = sorted(names - {*COMMON, *MEDUSA, *ALWAYS_ALLOWED, "all"})
    if unknown:
        raise ValueError(f"--allow-changed-settings: unknown setting {', '.join(unknown)}; the settings a resume "
                         f"checks are {', '.join(COMMON + MEDUSA)} (or all)")
    return names


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[Change]:
    """The settings both record with different values, in :data:`COMMON` + :data:`MEDUSA` order. A name only one
    side records (a checkpoint of another version) is not compared, except those of :data:`RECORDED_SINCE`."""
    recorded = {**RECORDED_SINCE, **recorded}
    return [Change(name, recorded[name], current[name]) for name in COMMON + MEDUSA
            if name in recorded and name in current and recorded[name] != current[name]]


def check(recorded: dict[str, Any], current: dict[str, Any], allowed: set[str], checkpoint: Path) -> list[Change]:
    """The differences between a checkpoint's settings and this run's, all of them allowed; ValueError naming each
    one that is not."""
    found = differences(recorded, current)
    refused = [c for c in found if "all" not in allowed and c.name not in allowed]
    if refused:
        raise ValueError(f"--resume: {checkpoint} was trained with other settings: {describe(refused)}. Give the "
                         f"checkpoint's settings to continue its run; or add --allow-changed-settings "
                         f"{','.join(c.name for c in refused)} to go on with the new ones (the change is logged); or "
                         "start a new run in another --output-dir")
    return found


def describe(changes: list[Change]) -> str:
    """'batch-size 2 → 4; tokenizer: tokenizer.json 1a2b3c4d5e6f → 9f8e7d6c5b4a'."""
    return "; ".join(_change_text(c) for c in changes)


def _change_text(change: Change) -> str:
    old, new = change.old, change.new
    if isinstance(old, dict) and isinstance(new, dict):
        files = [f"{k} {_shown(old.get(k))} → {_shown(new.get(k))}" for k in sorted(old.keys() | new.keys())
                 if old.get(k) != new.get(k)]
        return f"{change.name}: {', '.join(files)}"
    return f"{change.name} {_shown(old)} → {_shown(new)}"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str) and _HEX.fullmatch(value):
        return value[:12]  # a digest: enough to tell two apart
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return str(value)


def logged(changes: list[Change]) -> dict[str, list]:
    """The changes as the metrics log records them: {name: [old, new]}."""
    return {c.name: [c.old, c.new] for c in changes}
