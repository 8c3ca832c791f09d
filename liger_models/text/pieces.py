"""A plain-text file streamed as pieces whose tokens, concatenated, are exactly the tokens of the whole text.

Encoding a text as one string holds the Rust tokenizer's Encoding of all of it (offsets, token strings, ~200 bytes
per input character) and runs on one core. Cut into pieces of about PIECE_CHARS characters, it is read a block at a
time and the pieces are encoded in parallel batches like JSONL documents (tokenize.py), in memory that does not grow
with the file beyond the token ids themselves.

Why the tokens stay the same. A model (BPE, WordPiece, ...) encodes each pre-token on its own, so only the
normalizer and the pre-tokenizer could see across a cut. Pieces are cut only where both provably behave the same
on the pieces as on the whole:

- normalizer none or NFC, and no added token that strips neighbouring spaces or holds a line break (so none spans a
  cut; added tokens are split out before pre-tokenizing, which the check below does not do, so a window holding one
  is not cut);
- the pre-tokenizer is one of the regex splits of KNOWN_PATTERNS (GPT-2's byte-level regex, Llama 3's and Qwen2's):
  none has a look-behind, so the tokens after a pre-token boundary do not depend on the text before it; and no
  alternative matches (or, backtracking, reads past) a line break into the first non-space character of the next
  line, so such a character always starts a pre-token, and the pre-tokens of a line depend on the text only up to
  the first character of the next non-indented line;
- the cut is in a run of blank lines between two non-indented lines, and the pre-tokenizer, run on the line before
  the run, the run and the next line's first character, has a boundary at the cut and gives the same pre-tokens
  before it as on the text before the cut alone. By the two properties above that check is exact: it proves the
  whole text's pre-tokens are the pieces' pre-tokens, concatenated. Which position in the run passes depends on
  the regex (GPT-2's keeps "\\n\\n" before a word as two pre-tokens, Llama 3's as one): the run's end is tried,
  then the place before its last newline.

The special tokens the post-processor adds to a whole text (BOS, or RoBERTa's <s> ... </s>) go before the first
piece and after the last one (:func:`added_ends`). Any other tokenizer, or a text without such a run of blank
lines, is encoded whole; a large one is reported (LARGE_TEXT_BYTES).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer

from liger_models.input_files import not_utf8, read_text

PIECE_CHARS = 1 << 15  # about 32 pieces per encode_batch call of train/dataset.ENCODE_CHUNK_CHARS: every core busy
_READ_CHARS = 1 << 20
# Above this a text encoded whole costs gigabytes (about 200 bytes per character): said once per file.
LARGE_TEXT_BYTES = 16 << 20
_GPT2 = "ByteLevel's own regex"
# Pre-tokenizer split patterns with the two properties of the module docstring.
KNOWN_PATTERNS = {
    # Llama 3 (tiktoken's cl100k pattern; liger_models/convert/tiktoken_tokenizer.py PAT_STR)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "Llama 3",
    # Qwen2 / Qwen2.5 / Qwen3: the same with single digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "Qwen2",
}
_BLANK_LINES = re.compile(r"(?<=\S)\n{2,}(?=\S)")  # newlines are "\n" here: files are read with universal newlines
_PROBES = ("a", "b\n\nc d")  # texts whose special tokens tell what the post-processor adds around any text


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _pre_tokenizer_problem(state: dict | None) -> str | None:
    """None when the pre-tokenizer is a known regex split (module docstring), else what it is."""
    if state is None:
        return "it has no pre-tokenizer (merges may span lines)"
    if state.get("type") == "ByteLevel":
        if state.get("use_regex") and not state.get("add_prefix_space"):
            return None
    elif state.get("type") == "Sequence" and len(state.get("pretokenizers", [])) == 2:
        split, byte_level = state["pretokenizers"]
        if (split.get("type") == "Split" and split.get("pattern", {}).get("Regex") in KNOWN_PATTERNS
                and split.get("behavior") == "Isolated" and not split.get("invert")
                and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex")
                and not byte_level.get("add_prefix_space")):
            return None
    return f"its pre-tokenizer is not one of the known regex splits ({_GPT2}, {', '.join(KNOWN_PATTERNS.values())})"


def added_ends(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after any single text (BOS; RoBERTa's <s> and </s>), or None
    when they differ between texts (then a text cannot be encoded in pieces)."""
    ends = None
    for text in _PROBES:
        full = tokenizer.encode(text, add_special_tokens=True).ids
        bare = tokenizer.encode(text, add_special_tokens=False).ids
        found = next(((full[:i], full[i + len(bare):]) for i in range(len(full) - len(bare) + 1)
                      if full[i:i + len(bare)] == bare), None)
        if found is None or (ends is not None and found != ends):
            return None
        ends = found
    return ends


def _problem(tokenizer: Tokenizer) -> str | None:
    """Why ``tokenizer`` cannot encode a text in pieces with the whole text's tokens, or None when it can."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        return "it truncates or pads"
    normalizer = _state(tokenizer.normalizer)
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"its normalizer ({normalizer.get('type')}) may act across lines"
    if getattr(tokenizer.model, "dropout", None):
        return "its BPE has dropout (random tokens)"
    for token in tokenizer.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or "\n" in token.content or "\r" in token.content:
            return f"its added token {token.content!r} strips spaces or holds a line break"
    problem = _pre_tokenizer_problem(_state(tokenizer.pre_tokenizer))
    if problem is None and added_ends(tokenizer) is None:
        problem = "its post-processor adds tokens that depend on the text"
    return problem


class TextSplitter:
    """Cuts plain texts into pieces for ``tokenizer`` (module docstring); ``reason`` says why it cannot (then a
    text is one piece)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reason = _problem(tokenizer)
        self._added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]

    def _pre_tokens(self, text: str) -> list | None:
        if self.tokenizer.normalizer is not None and self.tokenizer.normalizer.normalize_str(text) != text:
            return None  # offsets would be the normalized text's: such a window is skipped, not reasoned about
        return self.tokenizer.pre_tokenizer.pre_tokenize_str(text)

    def _holds(self, text: str, line: int, cut: int, end: int) -> bool:
        """Whether the pre-tokens of text[line:end] split at ``cut`` as the pre-tokens of text[line:cut] alone."""
        window, before = self._pre_tokens(text[line:end]), self._pre_tokens(text[line:cut])
        if window is None or before is None:
            return False
        head = [t for t in window if t[1][0] < cut - line]
        return head == before and any(t[1][0] == cut - line for t in window)

    def cut(self, text: str, start: int) -> int | None:
        """The first position ≥ ``start`` where ``text`` (which begins at a cut or at its file's start) may be cut,
        or None when the text holds none."""
        for run in _BLANK_LINES.finditer(text, start):
            line = text.rfind("\n", 0, run.start()) + 1  # the start of the line before the blank lines
            if line > 0 and text[line].isspace():
                continue  # an indented line: where its first pre-token starts depends on the text before
            end = run.end() + 1  # the next line's first character: how far the regex reads (module docstring)
            if any(token in text[line:end] for token in self._added):
                continue
            for cut in (run.end(), run.end() - 1):
                if self._holds(text, line, cut, end):
                    return cut
        return None

    def pieces(self, path: str | os.PathLike) -> Iterator[str]:
        """The text of ``path`` (UTF-8, read as Path.read_text reads it: universal newlines, a leading byte-order
        mark dropped) in pieces of about PIECE_CHARS characters, or whole when the tokenizer cannot cut it."""
        if self.reason is not None:
            _warn_if_large(path, os.path.getsize(path), f"the tokenizer cannot cut it: {self.reason}")
            yield read_text(path)
            return
        buffer, pos, scan, warned = "", 0, 0, False
        for block in _blocks(path):
            buffer, scan = buffer[pos:] + block, scan - pos
            pos = 0
            while (cut := self.cut(buffer, max(scan, pos + PIECE_CHARS))) is not None:
                yield buffer[pos:cut]
                pos = scan = cut
            # Nothing before the trailing spaces can be cut (a run of blank lines there may still grow).
            scan = max(scan, pos + PIECE_CHARS, _content_end(buffer, pos))
            if len(buffer) - pos >= LARGE_TEXT_BYTES and not warned:
                _warn_if_large(path, len(buffer) - pos, "no blank line between two unindented lines to cut at")
                warned = True
        yield buffer[pos:]


def _content_end(text: str, start: int) -> int:
    """The end of ``text`` without its trailing whitespace (not before ``start``)."""
    end = len(text)
    while end > start and text[end - 1].isspace():
        end -= 1
    return end


def _blocks(path: str | os.PathLike) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8-sig") as f:  # newline=None: "\r\n" and "\r" read as "\n", as read_text
            while block := f.read(_READ_CHARS):
                yield block
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def _warn_if_large(path: str | os.PathLike, size: int, why: str) -> None:
    if size >= LARGE_TEXT_BYTES:
        warnings.warn(f"{Path(path)}: {size / 2**20:.0f} MiB of text encoded as one piece ({why}): peak memory is "
                      "about 200 bytes per character and one core works; a .jsonl of documents streams instead",
                      stacklevel=3)
