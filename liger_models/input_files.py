"""Reading the files a user hands the package (configs, tokenizer settings, chat templates, data, prompts): every
failure is a ValueError that names the file, the line where there is one, and the problem, which the CLI prints as
one line.

The readers decode with Python's text layer (universal newlines, a byte-order mark dropped where training drops it);
only when that fails is the file scanned again in binary to find where its first invalid byte is, so the common
path costs nothing extra.
"""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path
from typing import Any

_BLOCK = 1 << 20  # bytes decoded at a time when locating an invalid byte


def not_utf8(path: str | os.PathLike, name: str | None = None) -> ValueError:
    """The error for a file that does not decode as UTF-8: the line and byte offset of its first invalid byte.
    ``name``: how the message names the file (default: its path)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines, offset = 1, 0
    where = "somewhere"  # the file changed since the failed read
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                # exc.object is the decoder's held-back bytes (an incomplete character, no newline) + this block.
                held = len(exc.object) - len(block)
                line = lines + exc.object[: exc.start].count(b"\n")
                where = f"line {line}, byte offset {offset - held + exc.start}: {exc.reason}"
                break
            lines += block.count(b"\n")
            offset += len(block)
    return ValueError(f"{name or path} is not UTF-8 text ({where}); convert it to UTF-8")


def read_text(path: str | os.PathLike, name: str | None = None, *, keep_bom: bool = False) -> str:
    """A UTF-8 text file's contents. A byte-order mark (Windows tools write one) is dropped, as training drops it
    from data, unless ``keep_bom``: a chat template file is read as transformers reads it, mark included."""
    try:
        return Path(path).read_text(encoding="utf-8" if keep_bom else "utf-8-sig")
    except UnicodeDecodeError:
        raise not_utf8(path, name) from None


def read_json(path: str | os.PathLike) -> Any:
    """A JSON file's value; a file that is not JSON is named with the line and column where parsing stopped."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        msg = exc.msg.removesuffix(" at")  # "Invalid control character at": the place follows
        raise ValueError(f"{str(path)!r} is not valid JSON: {msg} at line {exc.lineno} column {exc.colno}"
                         f"{' (the file is empty)' if not text.strip() else ''}") from None


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file that must hold an object (a config), with errors naming the file."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} is not a JSON object (got {type(value).__name__})")
    return value


def shorten(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to about ``limit`` characters: an error quoting a row of data stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text)} characters)"
