"""Shared checks for the gated-activation kernels, used by test_swiglu.py and test_geglu.py.

Each check takes the public function under test and the activation name it must match, runs it on fresh
random data and compares forward and backward with the float64 reference (docs/kernels.md#correctness-protocol), with
the eager bf16 HF expression as the bar for low-precision error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from liger_models.kernels.ops import gated_mlp as gm
from tests.helpers import DEVICE, assert_matches, poison_

EAGER = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


def activation_input(shape, dtype, *, leaf: bool) -> torch.Tensor:
    """Gate-like data (N(0, 2²)) either as a leaf that requires grad or as an autograd intermediate
    (what a projection produces, whose memory the backward may reuse)."""
    src = (2 * torch.randn(shape, device=DEVICE)).to(dtype).requires_grad_()
    return src if leaf else src.clone()


def _references(gate, up, activation, dout):
    """float64 reference (out, dgate, dup) and the eager same-dtype HF expression's (out, dgate, dup)."""
    g64, u64 = (t.detach().double().requires_grad_() for t in (gate, up))
    ref = gm.gated_mlp_reference(g64, u64, activation)
    ref_grads = torch.autograd.grad(ref, (g64, u64), dout.double())
    ge, ue = (t.detach().clone().requires_grad_() for t in (gate, up))
    eager = EAGER[activation](ge) * ue
    eager_grads = torch.autograd.grad(eager, (ge, ue), dout)
    return (ref, *ref_grads), (eager.detach(), *eager_grads)


def _dgate_scale(dout: torch.Tensor, up: torch.Tensor) -> float:
    """The scale d gate = dout·u·a'(x) is computed at. a'(x) crosses zero (SiLU's near x = −1.28, the GELUs' near
    −0.75) as a sum of O(1) terms (Φ(x) + x·φ(x)), so near the crossing any fp32 evaluation, eager PyTorch's too, is
    off by ~1e-7 of |dout·u|: a tensor whose every element sits there is only that accurate relative to itself
    (test_packed's single element, one CI seed: gate −0.7524, d gate −2.006e-5 off by 2.7e-9, |dout·u| 0.073)."""
    return (dout.double() * up.double()).abs().max().item()


def check_packed(fn, activation: str, lead: tuple, width: int, dtype: torch.dtype, leaf: bool) -> None:
    gate_up = activation_input((*lead, 2 * width), dtype, leaf=leaf)
    before = gate_up.detach().clone()
    dout = torch.randn((*lead, width), device=DEVICE, dtype=dtype)
    gate, up = before[..., :width], before[..., width:]
    (ref, dg_ref, du_ref), (eag, dg_eag, du_eag) = _references(gate, up, activation, dout)
    out = fn(gate_up)
    assert_matches(out, ref, eager=eag, name="out")
    (dgu,) = torch.autograd.grad(out, gate_up, dout)
    assert dgu.shape == gate_up.shape
    assert_matches(dgu[..., :width], dg_ref, eager=dg_eag, name="d gate", scale_floor=_dgate_scale(dout, up))
    assert_matches(dgu[..., width:], du_ref, eager=du_eag, name="d up")
    if leaf:
        assert torch.equal(gate_up.detach(), before), "a leaf's data must never be overwritten"
    else:
        assert dgu.data_ptr() == gate_up.data_ptr(), "an intermediate's memory should hold its gradient"


def check_unpacked(fn, activation: str, layout: str, dtype: torch.dtype) -> None:
    """gate/up as halves of a fused output, separate tensors, transposed views, row-strided views, or one of each
    ("mixed": gate a half of a fused output, up a tensor of its own, so their row strides differ)."""
    rows, width = 6, 37
    if layout == "halves":
        gu = activation_input((2, 3, 2 * width), dtype, leaf=False)
        gate, up, params = gu[..., :width], gu[..., width:], (gu,)
    elif layout == "mixed":  # both intermediates: the gradients go in place, each with its own row stride
        gu = activation_input((rows, 2 * width), dtype, leaf=False)
        gate, up = gu[:, :width], activation_input((rows, width), dtype, leaf=False)
        params = (gu, up)
    elif layout == "separate":
        gate, up = (activation_input((rows, width), dtype, leaf=False) for _ in range(2))
        params = (gate, up)
    elif layout == "transposed":
        gate, up = (activation_input((width, rows), dtype, leaf=True).t() for _ in range(2))
        params = (gate._base, up._base)
    else:  # row-strided: every other row of a wider buffer
        big = activation_input((2 * rows, 3 * width), dtype, leaf=False)
        gate, up, params = big[::2, 5:5 + width], big[::2, 2 * width:], (big,)
    dout = torch.randn(gate.shape, device=DEVICE, dtype=dtype)
    (ref, dg_ref, du_ref), (eag, dg_eag, du_eag) = _references(gate, up, activation, dout)
    dgate_scale = _dgate_scale(dout, up)  # now: the backward may write d up over up's memory
    out = fn(gate, up)
    assert_matches(out, ref, eager=eag, name="out")
    grads = torch.autograd.grad(out, params, dout)
    if layout == "halves":
        dgate, dup = grads[0][..., :width], grads[0][..., width:]
    elif layout == "separate":
        dgate, dup = grads
    elif layout == "mixed":
        dgate, dup = grads[0][:, :width], grads[1]
        assert (grads[0][:, width:] == 0).all(), "gradient leaked into the unused half"
        # In place, or fresh contiguous gradients would share one row stride and the case would test nothing new.
        assert dup.data_ptr() == up.data_ptr(), "up's gradient was expected over up's own memory"
    elif layout == "transposed":
        dgate, dup = grads[0].t(), grads[1].t()
    else:
        dgate, dup = grads[0][::2, 5:5 + width], grads[0][::2, 2 * width:]
        untouched = torch.ones_like(grads[0], dtype=torch.bool)
        untouched[::2, 5:5 + width] = False
        untouched[::2, 2 * width:] = False
        assert (grads[0][untouched] == 0).all(), "gradient leaked outside gate/up"
    assert_matches(dgate, dg_ref, eager=dg_eag, name="d gate", scale_floor=dgate_scale)
    assert_matches(dup, du_ref, eager=du_eag, name="d up")


def check_closed_form_backward(activation: str) -> None:
    """gated_mlp_reference_backward (the CPU path's backward, no autograd) against autograd of the float64 reference,
    over the activation's whole useful range, the far negative tail included; float64 to 1e-12, fp32 to 2e-6."""
    x = torch.cat([torch.linspace(-40, 40, 4001, dtype=torch.float64), 3 * torch.randn(999, dtype=torch.float64)])
    u, d = torch.randn_like(x), torch.randn_like(x)
    g64, u64 = (t.clone().requires_grad_() for t in (x, u))
    ref = torch.autograd.grad(gm.gated_mlp_reference(g64, u64, activation), (g64, u64), d)
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        got = gm.gated_mlp_reference_backward(x.to(dtype), u.to(dtype), d.to(dtype), activation)[:2]
        for g, r in zip(got, ref):
            assert g.dtype == dtype
            torch.testing.assert_close(g.double(), r, rtol=rtol, atol=rtol * r.abs().max().item())


def check_launchers_poisoned(activation: str, rows: int, width: int, dtype: torch.dtype) -> None:
    """The launchers write every element of preallocated (NaN-poisoned) outputs, for odd shapes."""
    gate = (2 * torch.randn(rows, width, device=DEVICE)).to(dtype)
    up = torch.randn(rows, width, device=DEVICE).to(dtype)
    dout = torch.randn(rows, width, device=DEVICE).to(dtype)
    (ref, dg_ref, du_ref), (eag, dg_eag, du_eag) = _references(gate, up, activation, dout)
    out = poison_(torch.empty_like(gate))
    gm.gated_forward(gate, up, out, activation)
    assert_matches(out, ref, eager=eag, name="out")
    dgate_scale = _dgate_scale(dout, up)
    dgate, dup = poison_(torch.empty_like(gate)), poison_(torch.empty_like(up))
    gm.gated_backward(dout, gate, up, dgate, dup, activation)
    assert_matches(dgate, dg_ref, eager=dg_eag, name="d gate", scale_floor=dgate_scale)
    assert_matches(dup, du_ref, eager=du_eag, name="d up")
    # The fused-layer form: gradients in place over gate/up and the product over dout, in one pass; the product
    # is bit-identical to the forward's.
    gate_up = torch.cat([gate, up], dim=1)
    dprod = dout.clone()
    gm.gated_backward(dprod, gate_up[:, :width], gate_up[:, width:], gate_up[:, :width], gate_up[:, width:],
                      activation, product2d=dprod)
    assert torch.equal(dprod, out), "the product written by the backward differs from the forward's"
    assert_matches(gate_up[:, :width], dg_ref, eager=dg_eag, name="d gate (in place)", scale_floor=dgate_scale)
    assert_matches(gate_up[:, width:], du_ref, eager=du_eag, name="d up (in place)")


def check_aliasing_safety(fn, fn_packed, activation: str) -> None:
    """In-place gradient reuse never corrupts silently: a producer that saved its output fails loudly, and
    gate == up (one tensor for both) still gets correct, separate gradients."""
    src = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    gate_up = src.exp()  # exp saves its output for its own backward
    out = fn_packed(gate_up)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    x = activation_input((3, 9), torch.float32, leaf=False)
    dout = torch.randn(3, 9, device=DEVICE)
    (ref, dg_ref, du_ref), _ = _references(x, x, activation, dout)
    (dx,) = torch.autograd.grad(fn(x, x), x, dout)
    assert_matches(dx, dg_ref + du_ref, name="d x (gate is up)")


def check_edges_and_errors(fn, fn_packed) -> None:
    """No rows at all is fine; malformed input raises a clear Python error naming the problem."""
    empty = activation_input((0, 8), torch.float32, leaf=False)
    out = fn_packed(empty)
    assert out.shape == (0, 4)
    (d,) = torch.autograd.grad(out, empty, torch.ones(0, 4, device=DEVICE))
    assert d.shape == (0, 8)
    with pytest.raises(ValueError, match="even"):
        fn_packed(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="same shape"):
        fn(torch.randn(2, 4, device=DEVICE), torch.randn(2, 5, device=DEVICE))
    with pytest.raises(TypeError, match="dtype"):
        fn(torch.randn(2, 4, device=DEVICE), torch.randn(2, 4, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        fn_packed(torch.ones(2, 4, device=DEVICE, dtype=torch.int32))


def check_double_backward_raises(fn, fn_packed) -> None:
    """create_graph=True fails clearly instead of returning gradients without their second-order terms, for leaf
    and intermediate inputs (whose memory the backward reuses) and for a constant incoming gradient."""
    for leaf in (True, False):
        gate, up = (activation_input((3, 9), torch.float32, leaf=leaf) for _ in range(2))
        gate_up = activation_input((3, 18), torch.float32, leaf=leaf)
        for out, inputs in ((fn(gate, up), (gate, up)), (fn_packed(gate_up), (gate_up,))):
            with pytest.raises(RuntimeError, match="create_graph"):
                torch.autograd.grad(out.sum(), inputs, create_graph=True)


def check_gpu_real_size(fn_packed, activation: str, rows: int, width: int) -> None:
    """bf16 at a real training size, in place on an intermediate, against an fp32 reference (rel L2)."""
    gate_up = activation_input((rows, 2 * width), torch.bfloat16, leaf=False)
    x = gate_up.detach().float()
    dout = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    out = fn_packed(gate_up)
    ref = gm.gated_mlp_reference(x[:, :width], x[:, width:], activation)
    assert_matches(out, ref)
    (dgu,) = torch.autograd.grad(out, gate_up, dout)
    xr = x.requires_grad_()
    (dref,) = torch.autograd.grad(gm.gated_mlp_reference(xr[:, :width], xr[:, width:], activation), xr, dout.float())
    assert_matches(dgu, dref)


def check_gpu_above_int32(fn_packed, activation: str) -> None:
    """A packed bf16 input of more than 2^31 elements (~4.3 GB): forward and backward checked in chunks."""
    width = 4096
    rows = 2**31 // (2 * width) + 3
    gate_up = activation_input((rows, 2 * width), torch.bfloat16, leaf=False)
    assert gate_up.numel() > 2**31
    x = gate_up.detach().clone()
    dout = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    out = fn_packed(gate_up)
    (dgu,) = torch.autograd.grad(out, gate_up, dout)
    chunk = 16384
    for start in range(0, rows, chunk):
        xs = x[start:start + chunk].float().requires_grad_()
        ref = gm.gated_mlp_reference(xs[:, :width], xs[:, width:], activation)
        assert_matches(out[start:start + chunk], ref, name=f"out rows {start}+")
        (dref,) = torch.autograd.grad(ref, xs, dout[start:start + chunk].float())
        assert_matches(dgu[start:start + chunk], dref, name=f"d(gate_up) rows {start}+")


def check_backward_scaled(activation: str, rows: int, width: int, dtype: torch.dtype, scale_dtype: torch.dtype,
                          packed: bool) -> None:
    """gated_backward_scaled, in whichever form gated_mlp.TUNING and the dispatch select, against the unfused
    passes (the scaled copy rounded by torch.mul, gated_backward with the product, a float64 row dot): d gate, d up
    and the product bit-identical, the row dots within fp32 summation error, into NaN-poisoned outputs; ``packed``:
    gate and up are the halves of one (rows, 2·width) tensor written in place and the gradient a column slice of a
    wider one (row strides past the width)."""
    gate = (2 * torch.randn(rows, width, device=DEVICE)).to(dtype)
    up = torch.randn(rows, width, device=DEVICE).to(dtype)
    wide = torch.randn(rows, width + 3, device=DEVICE).to(dtype)
    grad = wide[:, 1:width + 1] if packed else wide[:, :width].clone()
    scale = torch.rand(rows, device=DEVICE).to(scale_dtype)
    scale[::3] = 0.0  # a row whose weight is zero still gets its product and row dot
    dout = torch.mul(grad, scale[:, None], out=torch.empty_like(grad))
    dgate_ref, dup_ref, prod_ref = (torch.empty_like(gate) for _ in range(3))
    gm.gated_backward(dout, gate, up, dgate_ref, dup_ref, activation, product2d=prod_ref)
    dots_ref = (grad.double() * prod_ref.double()).sum(dim=1)
    terms = (grad.double() * prod_ref.double()).abs().sum(dim=1)
    before = wide.clone()
    dots = poison_(torch.empty(rows, device=DEVICE))
    if packed:
        gate_up = torch.cat([gate, up], dim=1)
        dgate, dup = gate_up[:, :width], gate_up[:, width:]
        product = gm.gated_backward_scaled(grad, scale, dgate, dup, dgate, dup, activation, dots=dots)
        assert torch.equal(wide[:, 0], before[:, 0]) and torch.equal(wide[:, width + 1:], before[:, width + 1:]), \
            "columns beside the gradient's slice were written"
    else:
        dgate, dup = poison_(torch.empty_like(gate)), poison_(torch.empty_like(up))
        product = gm.gated_backward_scaled(grad, scale, gate, up, dgate, dup, activation, dots=dots)
    assert torch.equal(dgate, dgate_ref), "d gate differs from the unfused backward's"
    assert torch.equal(dup, dup_ref), "d up differs from the unfused backward's"
    assert torch.equal(product, prod_ref), "the product differs from the forward's"
    if gm.TUNING.fuse_scaled_backward and gm.use_triton(product):
        assert product.data_ptr() == grad.data_ptr(), "the fused pass writes the product over the gradient"
    err = (dots.double() - dots_ref).abs()
    assert bool((err <= 2e-6 * terms + 1e-30).all()), (err / terms.clamp_min(1e-30)).max().item()
