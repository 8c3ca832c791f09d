"""Fixtures of the LoRA CLI tests: a tiny base with its tokenizer and a text file, and the PyTorch reference ops."""

from __future__ import annotations

import pytest

from ..helpers import make_tiny_model_dir, shakespeare


@pytest.fixture(scope="module")
def base_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cli")
    data = root / "data.txt"
    data.write_text(shakespeare(6_000), encoding="utf-8")
    return make_tiny_model_dir(root / "base"), data


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference path: fast on CPU
