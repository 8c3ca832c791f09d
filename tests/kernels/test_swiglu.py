"""SwiGLU (silu(gate) * up): forward and backward against the float64 reference, packed and strided inputs."""

import contextlib

import pytest
import torch

from liger_models.kernels._dispatch import reference_mode
from liger_models.kernels.ops import gated_mlp as gm
from liger_models.kernels.ops.swiglu import swiglu, swiglu_packed
from tests.helpers import BIG_MEMORY, DEVICE, poison_
from tests.kernels import gated_checks as checks

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leaf", [False, True], ids=["intermediate", "leaf"])
@pytest.mark.parametrize("lead, width", [((1,), 1), ((5,), 127), ((2, 3), 1023), ((2,), 4097), ((3, 1), 64)])
def test_packed(lead, width, leaf, dtype):
    checks.check_packed(swiglu_packed, "silu", lead, width, dtype, leaf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["halves", "separate", "transposed", "row_strided", "mixed"])
def test_unpacked_strided(layout, dtype):
    checks.check_unpacked(swiglu, "silu", layout, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 127), (1, 1023), (2, 4097), (300, 5)])
def test_launchers_write_every_element(rows, width, dtype):
    checks.check_launchers_poisoned("silu", rows, width, dtype)


def test_closed_form_backward():
    checks.check_closed_form_backward("silu")


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


@pytest.mark.parametrize("lead", [(3,), (2, 0), (2, 3)])
def test_zero_width(lead):
    """An intermediate size of 0 (empty gate/up, as eager silu(gate) * up takes them): empty output and gradients,
    not a reshape error from viewing the rows as (-1, 0)."""
    gate_up = torch.randn((*lead, 0), device=DEVICE, requires_grad=True) * 1.0
    out = swiglu_packed(gate_up)
    assert out.shape == (*lead, 0)
    (d,) = torch.autograd.grad(out, gate_up, torch.ones_like(out))
    assert d.shape == gate_up.shape
    gate, up = (torch.randn((*lead, 0), device=DEVICE, requires_grad=True) for _ in range(2))
    out = swiglu(gate, up)
    assert out.shape == (*lead, 0)
    assert [g.shape for g in torch.autograd.grad(out, (gate, up), torch.ones_like(out))] == [gate.shape] * 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("fused_layer", [False, True], ids=["autograd", "launchers"])
def test_gpu_inputs_on_another_device_than_the_current(fused_layer):
    """Tensors on cuda:1 while cuda:0 is current (a model split over GPUs): Triton launches on the current device,
    so the kernels must switch to the inputs' device, as the norms and losses do."""
    with torch.cuda.device(0):
        gate_up = torch.randn(257, 2 * 300, device="cuda:1", requires_grad=True) * 1.0
        dout = torch.randn(257, 300, device="cuda:1")
        x = gate_up.detach().clone()  # the backward writes d(gate_up) over gate_up's own memory
        ref = gm.gated_mlp_reference(x[:, :300], x[:, 300:], "silu")
        if fused_layer:  # modules/fused.py calls the launchers directly
            out, dgu = torch.empty_like(ref), torch.empty_like(x)
            gm.gated_forward(x[:, :300], x[:, 300:], out, "silu")
            gm.gated_backward(dout, x[:, :300], x[:, 300:], dgu[:, :300], dgu[:, 300:], "silu")
        else:
            out = swiglu_packed(gate_up)
            (dgu,) = torch.autograd.grad(out, gate_up, dout)
        torch.cuda.synchronize(1)
        xr = x.clone().requires_grad_()
        (dref,) = torch.autograd.grad(gm.gated_mlp_reference(xr[:, :300], xr[:, 300:], "silu"), xr, dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dgu, dref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("dtype, scale_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float32)])
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 127), (2, 4097), (300, 5)])
def test_backward_scaled_equals_the_unfused_backward(rows, width, dtype, scale_dtype, packed, tune):
    tune(gm, fuse_scaled_backward=True)  # the one-pass kernel (the default; set so a LIGER_TUNE run does not move it)
    checks.check_backward_scaled("silu", rows, width, dtype, scale_dtype, packed)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("form", ["reference", "unfused"])
def test_backward_scaled_other_forms_match(form, packed, tune):
    # The PyTorch path (the fused kernel switched on but reference mode forcing PyTorch), and the unfused kernels
    # (the bisection path), with row dots over chunks of 5 rows.
    tune(gm, fuse_scaled_backward=form != "unfused", row_dot_elements=5 * 130)
    with reference_mode() if form == "reference" else contextlib.nullcontext():
        checks.check_backward_scaled("silu", 37, 130, torch.bfloat16, torch.float32, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, scale_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("rows, width", [(2, 4097), (300, 5), (1031, 768), (67, 14336)])
def test_gpu_backward_scaled_equals_the_unfused_backward(rows, width, dtype, scale_dtype, tune):
    tune(gm, fuse_scaled_backward=True)
    # Compiled, at odd shapes and the experts' widths of Qwen3-30B-A3B (768) and Mixtral-8x7B (14336).
    for packed in (False, True):
        checks.check_backward_scaled("silu", rows, width, dtype, scale_dtype, packed)


@pytest.mark.parametrize("rows, width", [(0, 5), (4, 0)])
def test_backward_scaled_empty(rows, width):
    # Nothing to launch; the row dots of empty rows are 0 (poisoned before).
    grad, gate, up = (torch.randn(rows, width, device=DEVICE) for _ in range(3))
    dots = poison_(torch.empty(rows, device=DEVICE))
    gm.gated_backward_scaled(grad, torch.rand(rows, device=DEVICE), gate, up, gate, up, "silu", dots=dots)
    assert torch.equal(dots, torch.zeros_like(dots))
