"""Fixtures for the training tests: a tiny Llama with a freshly trained byte-level BPE tokenizer, and some text.

Training tests exercise the loop, not the kernels (tests/kernels covers those under the Triton interpreter), so they
run the PyTorch reference path (TRITON_INTERPRET=0); liger_models/kernels/_dispatch.py reads the variable at call time.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest
import torch

from liger_models import AutoLigerForCausalLM, LigerLlamaForCausalLM, LlamaConfig
from liger_models.medusa import MedusaModel
from liger_models.train.data import save_tokenizer, train_bpe_tokenizer

EOS = "<|endoftext|>"


def shakespeare(chars: int) -> str:
    return importlib.resources.files("liger_models.data").joinpath("tiny_shakespeare.txt").read_text()[:chars]


def make_tiny_model_dir(path: Path, *, tie: bool = False, vocab: int = 320) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, GQA) + tokenizer saved in HF format under ``path``."""
    tokenizer = train_bpe_tokenizer(shakespeare(60_000).splitlines(), vocab_size=vocab, eos_token=EOS)
    config = LlamaConfig.tiny(vocab_size=tokenizer.get_vocab_size(), bos_token_id=None,
                              eos_token_id=tokenizer.token_to_id(EOS), pad_token_id=None, tie_word_embeddings=tie)
    LigerLlamaForCausalLM.from_config(config).save_pretrained(path)
    save_tokenizer(tokenizer, path, eos_token=EOS)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama_tied"), tie=True)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "shakespeare.txt"
    path.write_text(shakespeare(12_000), encoding="utf-8")
    return path


@pytest.fixture
def reference_path(monkeypatch):
    """Run models on the PyTorch reference path (fast on CPU)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def heads_dir(tiny_model_dir, tmp_path):
    """Fresh random heads for the tiny model (2 heads), saved as train-medusa saves them (the base named in
    config.json), with biases large enough that the heads' guesses differ from the base's."""
    base = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    medusa = MedusaModel.from_base(base, num_heads=2)
    for k in range(2):
        torch.nn.init.normal_(medusa.heads[k][0].linear.bias, std=3.0)
    out = tmp_path / "heads"
    medusa.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config["base_model_name_or_path"] = str(tiny_model_dir)
    (out / "config.json").write_text(json.dumps(config))
    return out
