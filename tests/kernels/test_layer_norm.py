"""layer_norm / LayerNorm against a float64 reference (docs/kernels.md#correctness-protocol), with and without bias.

On CPU the Triton kernels run in the interpreter with NaN-poisoned allocations; ``-m gpu`` runs real sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import liger_models.kernels.ops.rms_norm as rn
from liger_models.kernels.ops.layer_norm import LayerNorm, layer_norm, layer_norm_reference
from tests.helpers import DEVICE, assert_matches, poison_


@pytest.fixture(autouse=True)
def _poisoned_allocations(monkeypatch):
    """Outputs, mean/rstd and dW/dB partials come from torch.empty*: NaN-fill them so unwritten elements show."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


def _inputs(shape, dtype, bias, mean=0.0):
    x = torch.randn(shape, device=DEVICE) + mean
    w = torch.randn(shape[-1], device=DEVICE) * 0.5 + 1.0
    b = torch.randn(shape[-1], device=DEVICE) * 0.5 if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def _check(x, w, b, eps=1e-5, dy=None):
    """Forward and backward (dx, dw, db) vs float64, and vs eager F.layer_norm in the input dtype."""
    def run(fn, cast):
        leaves = [None if t is None else cast(t.detach()).requires_grad_() for t in (x, w, b)]
        y = fn(*leaves, eps)
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], cast(dy_))
        return y, grads

    dy_ = torch.randn(x.shape, device=x.device, dtype=x.dtype) if dy is None else dy
    y, grads = run(layer_norm, lambda t: t)
    y64, grads64 = run(layer_norm_reference, lambda t: t.double())
    ye, grads_e = run(lambda x_, w_, b_, eps_: F.layer_norm(x_, (x_.shape[-1],), w_, b_, eps_), lambda t: t)
    assert y.dtype == x.dtype
    assert_matches(y, y64, eager=ye, name="y")
    for name, g, g64, ge in zip(("dx", "dw", "db"), grads, grads64, grads_e):
        assert g.dtype == ge.dtype
        assert_matches(g, g64, eager=ge, name=name)


@pytest.mark.parametrize("shape", [(1, 64), (3, 127), (4, 1023), (2, 4097)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm(shape, bias, dtype):
    _check(*_inputs(shape, dtype, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_size_one_is_exact(dtype):
    # x − mean(x) ≡ 0: y = b, dx = dw = 0 exactly, db = Σ dy (a relative error against a float64 reference
    # whose "zero" is rounding noise would mean nothing here).
    x, w, b = (t.requires_grad_() for t in _inputs((5, 1), dtype, bias=True))
    y = layer_norm(x, w, b)
    dy = torch.randn_like(y)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    assert torch.equal(y, b.detach().expand(5, 1))
    if DEVICE == "cpu":
        assert (dx == 0).all() and (dw == 0).all()
    else:  # compiled, g − mean(g) may contract to fma(dy, w, −mean): the product's rounding error, times rstd
        g = (dy * w.detach()).float().abs().max().item()
        bound = 2.0 ** -22 * g * (1e-5) ** -0.5
        assert dx.float().abs().max() <= bound and dw.float().abs().max() <= bound
    # db is a sum of 5 fp32 terms that may cancel: accurate to the terms' scale, not the (possibly tiny) sum's.
    assert_matches(db, dy.double().sum(0), name="db", scale_floor=dy.double().abs().sum(0).max().item())


@pytest.mark.parametrize("shape", [(3, 127), (2, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_split_path(tune, shape, dtype):
    tune(rn, max_fused_fwd_n=64)
    tune(rn, max_fused_bwd_n=64)
    tune(rn, split_block_n=64)
    tune(rn, wide_bwd=False)
    _check(*_inputs(shape, dtype, bias=True, mean=30.0))  # a mean ≫ std: the separate mean pass matters


@pytest.mark.parametrize("shape", [(3, 127), (5, 250)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_backward(tune, shape, bias, dtype):
    tune(rn, max_fused_bwd_n=64)
    tune(rn, wide_chunk=64)  # rows of 2 and 4 chunks (with a tail): the one-kernel backward
    tune(rn, wide_ln_max_chunks=4)
    _check(*_inputs(shape, dtype, bias=bias, mean=30.0))


def test_large_mean_fused_path():
    _check(*_inputs((4, 1000), torch.float32, bias=True, mean=30.0))


def test_strided_inputs_and_grads():
    x = torch.randn(5, 300, device=DEVICE)[:, 7:134]  # row stride 300
    dy = torch.randn(3, 5, 127, device=DEVICE).transpose(0, 1)[:, 0]  # non-contiguous incoming grad
    _check(x, *_inputs((1, 127), torch.float32, bias=True)[1:], dy=dy)
    xt = torch.randn(4, 3, 127, device=DEVICE, dtype=torch.bfloat16).transpose(0, 1)  # does not collapse to rows
    _check(xt, *_inputs((1, 127), torch.bfloat16, bias=False)[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_weight_and_bias(dtype):
    # Weight and bias as strided views (columns of one (N, 2) buffer each): the kernels index them with a unit stride.
    x, w, b = _inputs((5, 127), dtype, bias=True)

    def strided(p):
        return torch.stack((p, torch.randn_like(p)), dim=1)[:, 0]

    _check(x, strided(w), strided(b))


def test_bias_dtype_differs_from_weight():
    # An fp32 bias beside a bf16 weight: dB = Σ dy is reduced in fp32 and must not pass through the weight's bf16.
    x, w, _ = _inputs((6, 127), torch.bfloat16, bias=False)
    w, b = w.requires_grad_(), torch.randn(127, device=DEVICE, requires_grad=True)
    y = layer_norm(x, w, b)
    dy = torch.randn_like(y)
    dw, db = torch.autograd.grad(y, (w, b), dy)
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    y64 = layer_norm_reference(x.double(), w64, b64)
    dw64, db64 = torch.autograd.grad(y64, (w64, b64), dy.double())
    assert db.dtype == torch.float32 and dw.dtype == torch.bfloat16
    assert_matches(y, y64, name="y")
    assert_matches(db, db64, name="db")
    assert_matches(dw, dw64, name="dw")


def test_double_backward_raises():
    # create_graph=True would otherwise return gradients without their second-order terms (no grad_fn).
    x, w, b = (t.requires_grad_() for t in _inputs((3, 33), torch.float32, bias=True))
    for loss in (layer_norm(x, w, b).pow(2).sum(), (layer_norm(x, w, b) * torch.randn_like(x)).sum()):
        with pytest.raises(RuntimeError, match="create_graph"):
            torch.autograd.grad(loss, (x, w, b), create_graph=True)


def test_dw_db_are_deterministic():
    x, w, b = _inputs((37, 255), torch.bfloat16, bias=True)
    dy = torch.randn_like(x)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        runs.append(torch.autograd.grad(layer_norm(*leaves), leaves, dy))
    for a, c in zip(*runs):
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))


@pytest.mark.parametrize("bias", [True, False])
def test_module(bias):
    m = LayerNorm(64, eps=1e-6, bias=bias, device=DEVICE)
    assert list(m.state_dict()) == (["weight", "bias"] if bias else ["weight"])
    x = torch.randn(2, 3, 64, device=DEVICE)
    y = m(x)
    assert torch.equal(y, layer_norm(x, m.weight, m.bias, 1e-6))
    y.sum().backward()
    assert m.weight.grad is not None and (m.bias is None or m.bias.grad is not None)


def test_frozen_affine():
    # weight and bias without requires_grad: only dx is computed (no dW/dB partials), and it is still right
    x, w, b = _inputs((3, 64), torch.float32, bias=True)
    xr, ref = x.clone().requires_grad_(), x.double().requires_grad_()
    dy = torch.randn_like(x)
    (dx,) = torch.autograd.grad(layer_norm(xr, w, b), (xr,), dy)
    (dx64,) = torch.autograd.grad(layer_norm_reference(ref, w.double(), b.double()), (ref,), dy.double())
    assert_matches(dx, dx64, name="dx")


def test_bad_inputs():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight shape"):
        layer_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match="bias shape"):
        layer_norm(x, torch.ones(8, device=DEVICE), torch.zeros(9, device=DEVICE))
    with pytest.raises(TypeError, match="floating-point"):
        layer_norm(torch.ones(2, 8, dtype=torch.int32, device=DEVICE), torch.ones(8, device=DEVICE))


def test_missing_weight_raises():
    # weight is required (F.layer_norm's weight=None is not supported): a clear error, not a crash in the kernel
    with pytest.raises(TypeError, match="weight"):
        layer_norm(torch.randn(2, 8, device=DEVICE), None)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (4096, 8192), (2048, 16384), (3000, 12000), (1024, 65536),
                                   (4095, 2047)])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_real_sizes(shape, bias):
    _check(*_inputs(shape, torch.bfloat16, bias))


@pytest.mark.gpu
def test_gpu_fp32_and_large_mean():
    _check(*_inputs((8192, 4096), torch.float32, bias=True, mean=30.0))
    _check(*_inputs((512, 32768), torch.float32, bias=True, mean=30.0))
