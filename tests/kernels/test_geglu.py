"""GeGLU (gelu(gate) * up, tanh approximation and exact erf): forward and backward against float64."""

import math

import pytest
import torch

from liger_models.kernels.ops import gated_mlp as gm
from liger_models.kernels.ops.geglu import geglu, geglu_packed
from tests.helpers import BIG_MEMORY, poison_
from tests.kernels import gated_checks as checks

DTYPES = [torch.float32, torch.bfloat16]
APPROX = {"tanh": "gelu_tanh", "none": "gelu"}


def _fns(approximate):
    return (lambda g, u: geglu(g, u, approximate=approximate)), (lambda gu: geglu_packed(gu, approximate=approximate))


@pytest.mark.parametrize("approximate", list(APPROX))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leaf", [False, True], ids=["intermediate", "leaf"])
@pytest.mark.parametrize("lead, width", [((1,), 1), ((5,), 127), ((2, 3), 1023), ((2,), 4097)])
def test_packed(lead, width, leaf, dtype, approximate):
    checks.check_packed(_fns(approximate)[1], APPROX[approximate], lead, width, dtype, leaf)


@pytest.mark.parametrize("approximate", list(APPROX))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["halves", "separate", "transposed", "row_strided", "mixed"])
def test_unpacked_strided(layout, dtype, approximate):
    checks.check_unpacked(_fns(approximate)[0], APPROX[approximate], layout, dtype)


@pytest.mark.parametrize("approximate", list(APPROX))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 127), (2, 4097), (300, 5)])
def test_launchers_write_every_element(rows, width, dtype, approximate):
    checks.check_launchers_poisoned(APPROX[approximate], rows, width, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp in the interpreter
def test_large_magnitudes_stay_finite():
    """|x| up to 1e4: σ saturates cleanly (no inf·0 NaN), matching the reference."""
    gate_up = torch.cat((torch.linspace(-1e4, 1e4, 64), torch.randn(64))).reshape(1, 128).to(checks.DEVICE)
    gate_up.requires_grad_()
    for approximate, activation in APPROX.items():
        x = gate_up.detach().double().requires_grad_()
        ref = gm.gated_mlp_reference(x[:, :64], x[:, 64:], activation)
        out = geglu_packed(gate_up, approximate=approximate)
        (d,) = torch.autograd.grad(out, gate_up, torch.ones_like(out))
        (dref,) = torch.autograd.grad(ref, x, torch.ones_like(ref))
        checks.assert_matches(out, ref, name=f"out {approximate}")
        checks.assert_matches(d, dref, name=f"d {approximate}")


def check_exact_gelu_grid(device: str, tol: float) -> None:
    """The erf-free Φ of the exact path, fp32, over x in [−14, 14] and beyond: a(x) and a'(x) within ``tol`` ×
    max(1, |ref|) of float64, and the lower tail (x in (−12, −3)) to a relative 2e-5, where 0.5·(1 + erf) fails."""
    x = torch.cat((torch.linspace(-14, 14, 28001), torch.tensor([-1e4, -40.0, 40.0, 1e4, 0.0]))).reshape(1, -1)
    x = x.to(device)
    out, dgate, dup = (poison_(torch.empty_like(x)) for _ in range(3))
    gm.gated_forward(x, torch.ones_like(x), out, "gelu")
    gm.gated_backward(torch.ones_like(x), x, torch.ones_like(x), dgate, dup, "gelu")
    x64 = x.double()
    cdf = 0.5 * torch.special.erfc(-x64 / math.sqrt(2.0))
    a, da = x64 * cdf, cdf + x64 * torch.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    assert ((out.double() - a).abs() / a.abs().clamp(min=1)).max().item() <= tol
    assert ((dgate.double() - da).abs() / da.abs().clamp(min=1)).max().item() <= tol
    assert torch.equal(dup, out)
    tail = (x64 > -12) & (x64 < -3)
    assert ((out.double() - a).abs() / a.abs())[tail].max().item() <= 2e-5


def test_exact_gelu_grid():
    check_exact_gelu_grid(checks.DEVICE, 2e-7)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_closed_form_backward(activation):
    checks.check_closed_form_backward(activation)


def test_reference_path_matches(monkeypatch):
    monkeypatch.setattr(gm, "use_triton", lambda *tensors: False)
    for approximate, activation in APPROX.items():
        checks.check_packed(_fns(approximate)[1], activation, (3,), 33, torch.float32, leaf=False)


@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
def test_far_negative_tail_is_relatively_exact(activation):
    """Down to gelu(−9) ≈ 1e-19 the fp32 kernel keeps ~6 significant digits against float64 (and so must the
    reference: its textbook 1 + tanh / 1 + erf form cancelled to 4% error at −7 in float64, a flaky CI failure)."""
    x = torch.tensor([[-9.0, -8.0, -7.0, -6.0, -5.0, -3.0, -1.0, 0.5, 4.0]], device=checks.DEVICE)
    out = poison_(torch.empty_like(x))
    gm.gated_forward(x, torch.ones_like(x), out, activation)
    ref = gm.gated_mlp_reference(x.double(), torch.ones_like(x).double(), activation)
    assert ((out.double() - ref).abs() / ref.abs()).max() < 1e-5
    # An independent float64 expression of the same function (no 1 + tanh / 1 + erf cancellation):
    z = (2 * math.sqrt(2 / math.pi)) * (x.double() + 0.044715 * x.double() ** 3)
    exact = x.double() / (1 + torch.exp(-z)) if activation == "gelu_tanh" else \
        0.5 * x.double() * torch.special.erfc(-x.double() / math.sqrt(2))
    torch.testing.assert_close(ref, exact, rtol=1e-12, atol=0)


def test_aliasing_safety():
    checks.check_aliasing_safety(*_fns("tanh"), "gelu_tanh")


def test_double_backward_raises():
    checks.check_double_backward_raises(*_fns("tanh"))


def test_edges_and_errors():
    checks.check_edges_and_errors(*_fns("tanh"))
    with pytest.raises(ValueError, match="approximate"):
        geglu_packed(torch.randn(2, 4, device=checks.DEVICE), approximate="sigmoid")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", list(APPROX))
def test_gpu_gemma_size(approximate):
    checks.check_gpu_real_size(_fns(approximate)[1], APPROX[approximate], 16384, 16384)


@pytest.mark.gpu
def test_gpu_exact_gelu_grid():
    """Compiled: MUFU exp2/rsqrt are a few ulp looser than the interpreter's numpy."""
    check_exact_gelu_grid("cuda", 5e-7)


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_above_int32_elements():
    checks.check_gpu_above_int32(_fns("tanh")[1], "gelu_tanh")
