"""Training documents read from ``.txt`` and ``.jsonl`` files, one at a time.

``.txt``    the whole file is one document; every token is trained on. It is read and encoded in pieces cut at
            blank lines where that provably gives the whole text's tokens (pieces.py).
``.jsonl``  one document per line: ``{"text": ...}`` (every token trained) or
            ``{"messages": [{"role": ..., "content": ...}, ...]}`` (chat, rendered by chat.py: loss on assistant
            turns only).
A blank text (a file or ``"text"`` of whitespace only) is skipped: with BOS/EOS added it would teach BOS → EOS.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

from liger_models.input_files import not_utf8, read_text, shorten
from liger_models.text.chat import Document, render_chat, training_renderer, uses_model_template
from liger_models.text.pieces import TextSplitter
from liger_models.tokenizer import SpecialTokens


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list, got {shorten(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} needs string 'role' and 'content' fields, got {shorten(m)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing to train on")


def iter_documents(paths: Sequence[str | os.PathLike], special: SpecialTokens, chat_template: str = "auto",
                   splitter: TextSplitter | None = None) -> Iterator[Document]:
    """Read ``.txt`` / ``.jsonl`` files into documents one at a time (formats: module docstring), so a corpus is
    never held in memory as a whole; blank plain texts are left out (nothing to learn). ``splitter``: a plain
    text comes in pieces (``first`` / ``last``) that encode to its tokens (pieces.py), else whole."""
    use_model = uses_model_template(chat_template, special)
    renderer = functools.cache(lambda: training_renderer(special.chat_template, special))  # compiled once, if needed
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        if path.suffix not in (".txt", ".jsonl"):
            raise ValueError(f"unsupported data file {path}: expected .txt or .jsonl")
        if path.suffix == ".txt":
            yield from _text_documents(path, splitter)
            continue
        try:
            yield from _jsonl_documents(path, special, renderer if use_model else None)
        except UnicodeDecodeError:  # the bare error says neither which file, nor where, nor what to do
            raise not_utf8(path) from None


def _text_documents(path: Path, splitter: TextSplitter | None) -> Iterator[Document]:
    """A .txt file as one document, in pieces when ``splitter`` cuts it; nothing when it is blank."""
    pieces = splitter.pieces(path) if splitter is not None else iter([read_text(path)])
    text, after = next(pieces), next(pieces, None)
    if after is None:  # one piece: the whole text
        if text.strip():
            yield Document(text)
        return
    yield Document(text, last=False)  # a text with a cut is not blank: both sides of a cut hold words
    for piece in pieces:
        yield Document(after, first=False, last=False)
        after = piece
    yield Document(after, first=False)


def _jsonl_documents(path: Path, special: SpecialTokens, renderer) -> Iterator[Document]:
    """The documents of one .jsonl file (see :func:`iter_documents`); ``renderer()`` gives the model's chat
    template renderer, or renderer is None for the simple template."""
    # utf-8-sig: a BOM that Windows tools write at a file's start is an encoding mark, not text to train on.
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({_json_problem(exc, line)})") from None
            # A null field is an absent one: a mixed dataset exported by pandas / HF datasets writes every
            # column on every row ({"text": ..., "messages": null}).
            if isinstance(row, dict) and row.get("messages") is not None:
                _check_messages(row["messages"], where)
                yield render_chat(row["messages"], special, renderer and renderer(), where)
            elif isinstance(row, dict) and isinstance(row.get("text"), str):
                if row["text"].strip():
                    yield Document(row["text"])
            else:
                raise ValueError(f'{where}: expected {{"text": ...}} or {{"messages": [...]}}, got {shorten(row)}')


def _json_problem(exc: json.JSONDecodeError, line: str) -> str:
    # exc.msg alone is cut short ("Invalid control character at"); the place completes it.
    problem = exc.msg.removesuffix(" at")
    if exc.pos >= len(line.rstrip()):
        return f"{problem} at the end of the line: the row is cut short"
    return f"{problem} at column {exc.colno}"


def load_documents(paths: Sequence[str | os.PathLike], special: SpecialTokens,
                   chat_template: str = "auto") -> list[Document]:
    """All documents of ``paths`` as a list (see :func:`iter_documents`); raises when there are none."""
    docs = list(iter_documents(paths, special, chat_template))
    if not docs:
        raise ValueError(f"no documents in {[str(p) for p in paths]}")
    return docs
