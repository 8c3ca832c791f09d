"""Fixtures of the training and CLI tests (tests/train, tests/cli): a tiny Llama with a freshly trained byte-level BPE
tokenizer, Medusa heads for it, and some text. Registered by tests/conftest.py (pytest_plugins), so that one session
builds each of them once for both folders.

Training tests exercise the loop, not the kernels (tests/kernels covers those under the Triton interpreter), so they
run the PyTorch reference path (TRITON_INTERPRET=0); liger_models/kernels/_dispatch.py reads the variable at call time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.medusa import MedusaModel
from tests.helpers import make_tiny_model_dir, shakespeare


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
