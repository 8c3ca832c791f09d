"""SwiGLU (silu(gate) * up): forward and backward against the float64 reference, packed and strided inputs."""

import pytest
import torch

from liger_models.kernels import gated_mlp as gm
from liger_models.kernels.swiglu import swiglu, swiglu_packed
from tests.helpers import BIG_MEMORY
from tests.kernels import gated_checks as checks

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leaf", [False, True], ids=["intermediate", "leaf"])
@pytest.mark.parametrize("lead, width", [((1,), 1), ((5,), 127), ((2, 3), 1023), ((2,), 4097), ((3, 1), 64)])
def test_packed(lead, width, leaf, dtype):
    checks.check_packed(swiglu_packed, "silu", lead, width, dtype, leaf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["halves", "separate", "transposed", "row_strided"])
def test_unpacked_strided(layout, dtype):
    checks.check_unpacked(swiglu, "silu", layout, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 127), (1, 1023), (2, 4097), (300, 5)])
def test_launchers_write_every_element(rows, width, dtype):
    checks.check_launchers_poisoned("silu", rows, width, dtype)


def test_reference_path_matches(monkeypatch):
    """CPU tensors outside the interpreter take the PyTorch path through the same autograd.Function."""
    monkeypatch.setattr(gm, "use_triton", lambda *tensors: False)
    checks.check_packed(swiglu_packed, "silu", (3,), 33, torch.float32, leaf=False)
    checks.check_unpacked(swiglu, "silu", "separate", torch.bfloat16)


def test_aliasing_safety():
    checks.check_aliasing_safety(swiglu, swiglu_packed, "silu")


def test_double_backward_raises():
    checks.check_double_backward_raises(swiglu, swiglu_packed)


def test_edges_and_errors():
    checks.check_edges_and_errors(swiglu, swiglu_packed)


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_llama3_8b_size():
    checks.check_gpu_real_size(swiglu_packed, "silu", 16384, 14336)


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_above_int32_elements():
    checks.check_gpu_above_int32(swiglu_packed, "silu")
