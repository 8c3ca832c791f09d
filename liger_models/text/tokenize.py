"""Documents to token ids and a "has loss" mask, a batch at a time.

Documents are encoded a chunk at a time with ``Tokenizer.encode_batch``, which runs on every core in Rust; each
chunk becomes int32 ids and a bool loss mask (numpy), so no token passes through a Python list for long. The result
is bit-identical to encoding documents one by one (tests/train/test_data.py keeps that reference). BOS/EOS are
added the way the model's tokenizer does; a plain document is closed with EOS when the tokenizer has one.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer

from liger_models.text.chat import Document
from liger_models.text.pieces import added_ends
from liger_models.tokenizer import SpecialTokens


def _encode_batch(docs: Sequence[Document], tokenizer: Tokenizer) -> list:
    """Encodings of ``docs`` in order, computed in parallel by ``encode_batch``. Texts a chat template already
    opened with BOS, and pieces of a text, are encoded without the post-processor's special tokens (one batch per
    setting)."""
    encodings = [None] * len(docs)
    for adds_specials in (True, False):
        where = [i for i, d in enumerate(docs) if (d.whole and not d.template_bos) == adds_specials]
        if where:
            batch = tokenizer.encode_batch([docs[i].text for i in where], add_special_tokens=adds_specials)
            for i, enc in zip(where, batch):
                encodings[i] = enc
    return encodings


def _plain_tokens(enc, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    # Every token has loss; EOS closes the document unless the post-processor already put one there.
    ids = np.asarray(enc.ids, dtype=np.int32)
    if eos_id is not None and (ids.size == 0 or ids[-1] != eos_id):
        ids = np.append(ids, np.int32(eos_id))
    return ids, np.ones(ids.size, dtype=bool)


def _chat_tokens(enc, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    # A token has loss when its first character lies in an assistant span; tokens the post-processor added
    # (offsets (0, 0), special mask 1) never do.
    ids = np.asarray(enc.ids, dtype=np.int32)
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    start, end = offsets[:, 0], offsets[:, 1]
    in_span = np.zeros(ids.size, dtype=bool)
    for a, b in spans:
        in_span |= (a <= start) & (start < b)
    added = np.asarray(enc.special_tokens_mask, dtype=bool)
    return ids, in_span & ~added & (end > start)


def _piece_tokens(enc, doc: Document, ends: tuple[list[int], list[int]],
                  eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    # A piece of a plain text: the post-processor's tokens (``ends``: pieces.added_ends) go before the first
    # piece and after the last, and the last gets the EOS a whole text would (_plain_tokens).
    before, after = ends
    ids = np.asarray((before if doc.first else []) + enc.ids + (after if doc.last else []), dtype=np.int32)
    if doc.last and eos_id is not None and (ids.size == 0 or ids[-1] != eos_id):
        ids = np.append(ids, np.int32(eos_id))
    return ids, np.ones(ids.size, dtype=bool)


def tokenize_chunk(docs: Sequence[Document], tokenizer: Tokenizer,
                   special: SpecialTokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``docs`` tokenized and concatenated: int32 ids, a bool "has loss" mask, and each document's (or piece's)
    token count. EOS is appended to plain documents when the tokenizer has one."""
    ends = added_ends(tokenizer) if not all(doc.whole for doc in docs) else None
    per_doc = [_piece_tokens(enc, doc, ends, special.eos_id) if not doc.whole
               else _plain_tokens(enc, special.eos_id) if doc.spans is None else _chat_tokens(enc, doc.spans)
               for doc, enc in zip(docs, _encode_batch(docs, tokenizer))]
    lengths = np.array([ids.size for ids, _ in per_doc], dtype=np.int64)
    if not per_doc:
        return np.zeros(0, np.int32), np.zeros(0, bool), lengths
    return np.concatenate([i for i, _ in per_doc]), np.concatenate([m for _, m in per_doc]), lengths


def tokenize_document(doc: Document, tokenizer: Tokenizer, special: SpecialTokens) -> tuple[list[int], list[bool]]:
    """One document's token ids and "has loss" mask as lists (:func:`tokenize_chunk` of one)."""
    ids, mask, _ = tokenize_chunk([doc], tokenizer, special)
    return ids.tolist(), mask.tolist()


def chunks(docs: Iterable[Document], max_chars: int) -> Iterator[list[Document]]:
    # Enough documents per encode_batch call to keep every core busy, few enough that the chunk's Encodings
    # (offsets, token strings: ~100 bytes a token in Rust) stay small.
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc.text)
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk
