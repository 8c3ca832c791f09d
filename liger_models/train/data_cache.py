"""On-disk cache of packed training data, so a resumed or repeated run (and every rank but one) skips tokenizing.

One entry is one safetensors file, ``<key>.safetensors``, holding the int32 (N, T) ``input_ids``, ``labels`` and
``position_ids`` of a :class:`~liger_models.train.packing.PackedDataset`. The key is a SHA-256 over everything the
windows depend on: each data file's bytes and suffix (in order), the serialized tokenizer (``Tokenizer.to_str()``:
what tokenizer.json holds, as loaded), the special tokens and chat template text, the chat template choice,
``seq_len``, the ``tokenizers`` version and :data:`FORMAT_VERSION` (bump it whenever tokenizing or packing changes).

Files are written to a temporary name, fsynced and renamed into place, so a reader sees a whole file or none. A
file is trusted only when its header parses, its metadata names the same key, its tensors have the expected dtype,
shapes and extents, the file has exactly the size they need, and the SHA-256 of the data matches the one stored
with it; anything else is reported and rebuilt. Tensors of a hit are memory-mapped copy-on-write. A directory
that cannot take the file is reported too, and the run goes on uncached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import tokenizers
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from liger_models import atomic
from liger_models.train.checkpointing import fsync_dir

FORMAT_VERSION = 2  # 2: a UTF-8 BOM starting a data file is not text; chat templates see tools=None as in HF
TENSORS = ("input_ids", "labels", "position_ids")
_BLOCK = 1 << 20  # bytes read at a time when hashing a data file
_MAX_HEADER = 1 << 20  # a header of three tensors is a few hundred bytes; more means the file is not ours


_remembered: dict[tuple, str] | None = None  # file_digest's results inside digests_remembered()


@contextlib.contextmanager
def digests_remembered() -> Iterator[None]:
    """Within the block, :func:`file_digest` reads each file once (by path, size, modification time and inode): a
    run hashes its data for the settings its checkpoints record (run_settings.py) and again for the cache key."""
    global _remembered
    outer = _remembered
    _remembered = {} if outer is None else outer
    try:
        yield
    finally:
        _remembered = outer


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read a block at a time (a corpus may not fit in memory)."""
    key = None
    if _remembered is not None:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if key in _remembered:
            return _remembered[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    if key is not None:
        _remembered[key] = digest.hexdigest()
    return digest.hexdigest()


def dataset_key(paths: Sequence[str | os.PathLike], tokenizer_json: str, special: dict, chat_template: str,
                seq_len: int) -> str:
    """The cache key: changes whenever the packed windows could (module docstring)."""
    files = []
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        files.append([path.suffix, file_digest(path)])  # the suffix decides how the bytes are read
    parts = {
        "format": FORMAT_VERSION,
        "tokenizers": tokenizers.__version__,
        "files": files,
        "tokenizer": hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(),
        "special": special,
        "chat_template": chat_template,
        "seq_len": seq_len,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()


def _data_digest(arrays: Sequence[np.ndarray]) -> str:
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return digest.hexdigest()


def save(path: Path, key: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Write ``tensors`` (int32, the names in TENSORS) as ``path`` atomically: temp file, fsync, rename.

    Returns whether it was written. The cache only saves time: a directory that cannot take the file (read-only,
    full, a file in the way) is reported with a warning, and the caller goes on with the data it has just built
    rather than losing the tokenizing it did (and the run) to a cache it does not need."""
    tensors = {name: tensors[name].contiguous() for name in TENSORS}
    metadata = {"key": key, "format": str(FORMAT_VERSION),
                "sha256": _data_digest([tensors[name].numpy() for name in TENSORS])}
    tmp = atomic.temp_path(path)  # unique per process and write: ranks may race
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:  # safetensors reports its own I/O errors as the latter
        warnings.warn(f"data cache {path.parent} cannot take the tokenized data ({exc}); going on without "
                      "caching it", stacklevel=2)
        return False
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # the directory cannot be listed or written either: nothing was left there
            pass
    fsync_dir(path.parent)
    return True


def _read_header(path: Path) -> tuple[dict, int]:
    # safetensors layout: u64 little-endian header length, the JSON header, then the data.
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= _MAX_HEADER:
            raise ValueError(f"header length {size}")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + size


def _mapped(path: Path, data_start: int, entry: dict) -> np.ndarray:
    shape = entry["shape"]
    begin, end = entry["data_offsets"]
    if entry["dtype"] != "I32" or len(shape) != 2 or min(shape) < 1 or end - begin != shape[0] * shape[1] * 4:
        raise ValueError(f"unexpected tensor entry {entry}")
    # Copy-on-write: the pages come from the file as they are read, and nothing is ever written back.
    return np.memmap(path, dtype="<i4", mode="c", offset=data_start + begin, shape=tuple(shape))


def _load_checked(path: Path, key: str) -> dict[str, torch.Tensor]:
    header, data_start = _read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("key") != key or meta.get("format") != str(FORMAT_VERSION):
        raise ValueError("written under another key or format")
    entries = [header[name] for name in TENSORS]
    if len({tuple(e["shape"]) for e in entries}) != 1:
        raise ValueError("tensor shapes differ")
    if os.path.getsize(path) != data_start + max(e["data_offsets"][1] for e in entries):
        raise ValueError("file size does not match its header (truncated?)")
    arrays = [_mapped(path, data_start, e) for e in entries]
    if _data_digest(arrays) != meta.get("sha256"):
        raise ValueError("data checksum mismatch")
    return {name: torch.from_numpy(a) for name, a in zip(TENSORS, arrays)}


def load(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors stored under ``path`` for ``key``, or None when there is no such file or it cannot be trusted
    (module docstring); an untrusted file is reported with a warning, and the caller rebuilds it."""
    if not path.is_file():
        return None
    try:
        return _load_checked(path, key)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        warnings.warn(f"data cache {path} is unusable ({exc}); tokenizing again", stacklevel=2)
        return None
