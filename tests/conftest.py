"""Test configuration: without a GPU, Triton kernels run in Triton's CPU interpreter.

The variable must be set before anything imports triton, so it is set here, at collection time.
GPU-only tests carry ``@pytest.mark.gpu`` and are deselected by default (``pytest -m gpu`` runs them).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The tests' tensors are tiny: one thread avoids OpenMP spin contention, which made the suite 2-3x slower
    # on the 2-core CI machine.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `pytest -m gpu` on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run; the seed is printed (shown on failure) and ``LIGER_TEST_SEED`` replays it."""
    seed = int(os.environ.get("LIGER_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"LIGER_TEST_SEED={seed}")
    torch.manual_seed(seed)
    yield
