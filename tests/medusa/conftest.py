import os

import pytest


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """Run the base model's kernels through their PyTorch references: the kernels have their own tests, and Triton's
    CPU interpreter makes every tiny forward take ~1 s. A test that asks for `interpreted_kernels` keeps it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """The real Triton kernels in the interpreter (as tests/conftest.py sets up on a machine without CUDA)."""
    import torch

    if torch.cuda.is_available():
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert os.environ["TRITON_INTERPRET"] == "1"
