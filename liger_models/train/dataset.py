"""Training data files read, tokenized and packed into windows of ``seq_len`` tokens, cached on disk on request.

Documents (liger_models/text/documents.py) are streamed from the files and encoded a chunk at a time (about
ENCODE_CHUNK_CHARS characters: text/tokenize.py), then packed once (packing.py). ``build_dataset(..., cache_dir=DIR)``
keeps the packed windows on disk (data_cache.py) and loads them when nothing they depend on changed; the training
recipes cache under ``<output_dir>/.data_cache`` and, under torchrun, only rank 0 tokenizes.

Measured 2026-11-30 on a 2-core CPU: tiny Shakespeare as 375k JSONL paragraphs, 19.9M tokens (the demo's 2048-token
BPE), seq_len 1024 — one document at a time: 50 s, peak RSS +2.0 GB; batched: 17 s, +0.87 GB; cache hit
(238 MB file, hashing the 63 MB corpus, checksum and memory-map): 0.2 s.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer

from liger_models.text.documents import iter_documents
from liger_models.text.pieces import TextSplitter
from liger_models.text.tokenize import chunks, tokenize_chunk
from liger_models.tokenizer import SpecialTokens
from liger_models.train import data_cache
from liger_models.train.packing import PackedDataset, check_has_targets, pack_arrays

# Text per encode_batch call (text/tokenize.chunks): 1 MiB is as fast as 4 MiB on the measured corpus, with less
# memory.
ENCODE_CHUNK_CHARS = 1 << 20


def _tokenize_and_pack(paths, tokenizer: Tokenizer, special: SpecialTokens, seq_len: int,
                       chat_template: str) -> PackedDataset:
    """Stream the documents, tokenize them a chunk at a time, pack once (module docstring)."""
    id_parts, mask_parts, length_parts, first_parts = [], [], [], []
    documents = iter_documents(paths, special, chat_template, TextSplitter(tokenizer))
    for chunk in chunks(documents, ENCODE_CHUNK_CHARS):
        ids, mask, lengths = tokenize_chunk(chunk, tokenizer, special)
        id_parts.append(ids)
        mask_parts.append(mask)
        length_parts.append(lengths)
        first_parts.append(np.array([doc.first for doc in chunk], dtype=bool))
    if not length_parts:
        raise ValueError(f"no documents in {[str(p) for p in paths]}")
    # A text's pieces are one document: their token counts add up to its length.
    lengths = np.add.reduceat(np.concatenate(length_parts), np.flatnonzero(np.concatenate(first_parts)))
    dataset = pack_arrays(id_parts, mask_parts, lengths, seq_len, special.pad_id)
    check_has_targets(dataset)
    return dataset


def build_dataset(
    paths: Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    special: SpecialTokens,
    seq_len: int,
    chat_template: str = "auto",
    cache_dir: str | os.PathLike | None = None,
) -> PackedDataset:
    """Read, tokenize and pack ``paths`` into windows of ``seq_len`` tokens.

    ``cache_dir``: keep the packed windows there and, when the same data, tokenizer, template and ``seq_len`` come
    again, load them instead of tokenizing (data_cache.py: what the key covers, how files are checked)."""
    if cache_dir is None:
        return _tokenize_and_pack(paths, tokenizer, special, seq_len, chat_template)
    fields = {k: v for k, v in dataclasses.asdict(special).items() if k != "chat_template_file"}
    key = data_cache.dataset_key(paths, tokenizer.to_str(), fields, chat_template, seq_len)
    path = Path(cache_dir) / f"{key}.safetensors"
    tensors = data_cache.load(path, key)
    if tensors is not None:
        return PackedDataset(**tensors)
    dataset = _tokenize_and_pack(paths, tokenizer, special, seq_len, chat_template)
    data_cache.save(path, key, {"input_ids": dataset.input_ids, "labels": dataset.labels,
                                "position_ids": dataset.position_ids})
    return dataset
