"""Byte-level BPE tokenizers trained from text (the demo's and init-model's, and the tests')."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048, eos_token: str = "<|endoftext|>") -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style, every byte representable) trained on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | os.PathLike, eos_token: str = "<|endoftext|>") -> None:
    """Write ``tokenizer.json`` and a minimal ``tokenizer_config.json`` naming the EOS token."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
