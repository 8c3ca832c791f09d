"""Training data in one import: the names of the data pipeline, wherever they live.

The pipeline, bottom up: ``liger_models.tokenizer`` (special tokens, chat template files) → ``text/bpe.py`` (BPE
tokenizers trained from text) → ``text/chat.py`` (chat rendering) → ``text/documents.py`` (``.txt`` / ``.jsonl``
files as documents) → ``text/tokenize.py`` (ids and loss masks) → ``train/packing.py`` (windows) →
``train/dataset.py`` (files to packed windows, cached) → ``train/batches.py`` (a resumable batch stream).
"""

from __future__ import annotations

from liger_models.text.bpe import save_tokenizer, train_bpe_tokenizer
from liger_models.text.chat import (SIMPLE_ROLES, Document, chat_template_note, render_generation_prompt,
                                    render_model_template, render_simple)
from liger_models.text.documents import iter_documents, load_documents
from liger_models.text.tokenize import tokenize_chunk, tokenize_document
from liger_models.tokenizer import SpecialTokens, read_chat_template, read_special_tokens
from liger_models.train.batches import BatchStream, repeats_note
from liger_models.train.dataset import ENCODE_CHUNK_CHARS, build_dataset
from liger_models.train.packing import (IGNORE_INDEX, PackedDataset, batch_to, check_has_targets, pack_arrays,
                                        pack_documents)

__all__ = ["ENCODE_CHUNK_CHARS", "IGNORE_INDEX", "SIMPLE_ROLES", "BatchStream", "Document", "PackedDataset",
           "SpecialTokens", "batch_to", "build_dataset", "chat_template_note", "check_has_targets", "iter_documents",
           "load_documents", "pack_arrays", "pack_documents", "read_chat_template", "read_special_tokens",
           "render_generation_prompt", "render_model_template", "render_simple", "repeats_note", "save_tokenizer",
           "tokenize_chunk", "tokenize_document", "train_bpe_tokenizer"]
