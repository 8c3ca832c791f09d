"""Randomly initialised model directories (config + weights + a BPE tokenizer) for demos, tests and benchmarks.

``liger-models init-model --preset llama-3.2-1b --output-dir DIR`` writes a Llama-3.2-1B-shaped model (random HF
init, bf16) with a byte-level BPE tokenizer trained on the bundled text, so multi-GPU training runs need no
download. The tokenizer's vocabulary is smaller than the model's (the text has no 128K distinct merges); its ids
are all valid model ids, and the loss still spans the model's full vocabulary, as in the real model.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import torch

from liger_models.llama import LigerLlamaForCausalLM, LlamaConfig
from liger_models.text.bpe import save_tokenizer, train_bpe_tokenizer

EOS = "<|endoftext|>"

PRESETS: dict[str, dict] = {
    # The demo's model: 4 layers, hidden 256, GQA 8/2, tied embeddings (about 3.5 M parameters with a 2K vocab).
    "demo": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
    # meta-llama/Llama-3.2-1B's config.json shape.
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def bundled_text() -> str:
    """The tiny-Shakespeare text shipped in liger_models/data."""
    return importlib.resources.files("liger_models.data").joinpath("tiny_shakespeare.txt").read_text(encoding="utf-8")


def init_model_dir(out: str | Path, preset: str = "demo", *, tokenizer_text: str | None = None,
                   tokenizer_vocab: int = 2048, dtype: torch.dtype = torch.float32, device: str | None = None,
                   seed: int = 0, **overrides) -> Path:
    """Write a random-init Llama of ``preset`` shape (``overrides`` win) plus a BPE tokenizer to ``out``.

    The model's vocab_size defaults to the tokenizer's (a preset or override may make it larger).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: a file, not a directory; pick another --output-dir")
    written = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    if any((out / name).exists() for name in written) or any(out.glob("*.safetensors*")):
        # Random weights or a fresh tokenizer over a model directory would silently replace what may be trained.
        raise FileExistsError(f"{out} already holds a model or tokenizer; pick another --output-dir (or delete it "
                              "first)")
    text = tokenizer_text if tokenizer_text is not None else bundled_text()
    tokenizer = train_bpe_tokenizer(text.splitlines(), vocab_size=tokenizer_vocab, eos_token=EOS)
    fields = {"vocab_size": tokenizer.get_vocab_size(), **PRESETS[preset], **overrides}
    if fields["vocab_size"] < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size {fields['vocab_size']} < the tokenizer's {tokenizer.get_vocab_size()}")
    config = LlamaConfig(bos_token_id=None, eos_token_id=tokenizer.token_to_id(EOS), pad_token_id=None, **fields)
    torch.manual_seed(seed)
    model = LigerLlamaForCausalLM.from_config(config, device=device or "cpu").to(dtype)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out, eos_token=EOS)
    return out
