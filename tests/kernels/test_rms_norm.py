"""rms_norm / add_rms_norm / RMSNorm against a float64 reference (docs/kernels.md#correctness-protocol).

On CPU the Triton kernels run in the interpreter; every fresh tensor the kernels allocate is NaN-poisoned, so an
element a kernel forgets to write fails the comparison. ``-m gpu`` repeats the checks at real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import liger_models.kernels.ops.rms_norm as rn
from liger_models.kernels.ops.rms_norm import RMSNorm, add_rms_norm, rms_norm, rms_norm_reference
from tests.helpers import BIG_MEMORY, DEVICE, assert_matches, poison_

SHAPES = [(1, 1), (3, 127), (4, 1023), (2, 4097)]
MODES = [("llama", 0.0), ("gemma", 1.0)]


@pytest.fixture(autouse=True)
def _poisoned_allocations(monkeypatch):
    """Outputs, rstd and dW partials come from torch.empty*: fill them with NaN so unwritten elements show."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


@pytest.fixture
def split_rows(tune):
    """Force the long-row path (column blocks of 64) so the interpreter covers it on small shapes."""
    tune(rn, max_fused_fwd_n=64)
    tune(rn, max_fused_bwd_n=64)
    tune(rn, split_block_n=64)
    tune(rn, wide_bwd=False)


@pytest.fixture
def wide_rows(tune):
    """Rows of 2-4 chunks of 64 take the one-kernel wide backward; longer ones the split path."""
    tune(rn, max_fused_bwd_n=64)
    tune(rn, split_block_n=64)
    tune(rn, wide_chunk=64)


def _inputs(shape, dtype, casting, device=DEVICE):
    x = torch.randn(shape, device=device, dtype=dtype)
    # gemma weights live around 0 (used as 1 + w), llama weights around 1
    w = torch.randn(shape[-1], device=device) * 0.5 + (0.0 if casting == "gemma" else 1.0)
    return x, w.to(dtype)


def _eps(shape):
    # With hidden size 1, x̂ = ±1 up to eps and dx ∝ eps: at eps=1e-6 it is pure fp32 cancellation noise (eager
    # bf16 is off by up to 100%), so a well-conditioned eps is used there.
    return 0.1 if shape[-1] == 1 else 1e-6


def _grads(out, leaves, grads):
    return torch.autograd.grad(out, leaves, grads, allow_unused=True)


def _dx_terms(x, w, offset, dy, eps):
    """The size of the terms whose difference is dx = r·(w'·dy − x̂·mean(x̂·w'·dy)), w' = w + offset: max |r·w'·dy|.
    Where they cancel, fp32 is only as accurate as they are large (hidden size 1 with |x| ≫ √eps: one CI seed's dx
    was 88× smaller than them, and ours and eager fp32 were both ~1e-7 of them off), so it is dx's scale floor."""
    x64 = x.detach().double()
    r = (x64.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (r * (w.detach().double() + offset) * dy.detach().double()).abs().max().item()


def _check_rms_norm(x, w, casting, offset, eps=1e-6, dy=None):
    """Forward and backward of rms_norm(x, w) vs the float64 reference (and eager in x's dtype)."""
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    y = rms_norm(*leaves, eps, offset=offset, casting=casting)
    dy = torch.randn_like(y) if dy is None else dy
    dx, dw = _grads(y, leaves, dy)
    ref = [t.detach().double().requires_grad_() for t in (x, w)]
    y64 = rms_norm_reference(*ref, eps, offset, casting)
    dx64, dw64 = _grads(y64, ref, dy.double())
    eager = [t.detach().requires_grad_() for t in (x, w)]
    ye = rms_norm_reference(*eager, eps, offset, casting)
    dxe, dwe = _grads(ye, eager, dy)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert_matches(y, y64, eager=ye, name="y")
    assert_matches(dx, dx64, eager=dxe, name="dx", scale_floor=_dx_terms(x, w, offset, dy, eps))
    assert_matches(dw, dw64, eager=dwe, name="dw")


def _check_add_rms_norm(x, res, w, casting, offset, eps=1e-6, dr=None):
    """add_rms_norm: y and r, and grads of x, residual and w with incoming grads on both outputs (dr: r's, any
    layout; fresh random by default)."""
    leaves = [t.detach().requires_grad_() for t in (x, res, w)]
    y, r = add_rms_norm(*leaves, eps, offset=offset, casting=casting)
    dy, dr = torch.randn_like(y), torch.randn_like(r) if dr is None else dr
    got = _grads((y, r), leaves, (dy, dr))

    def reference(x_, res_, w_):
        r_ = x_ + res_
        if r_.dtype != x.dtype:  # float64: r rounded to x's dtype as the op (and HF) define it; gradient passes through
            r_ = r_ + (r_.to(x.dtype).to(r_.dtype) - r_).detach()
        return rms_norm_reference(r_, w_, eps, offset, casting), r_

    ref = [t.detach().double().requires_grad_() for t in (x, res, w)]
    y64, r64 = reference(*ref)
    want = _grads((y64, r64), ref, (dy.double(), dr.double()))
    eager = [t.detach().requires_grad_() for t in (x, res, w)]
    ye, re_ = reference(*eager)
    eager_grads = _grads((ye, re_), eager, (dy, dr))
    assert_matches(y, y64, eager=ye, name="y")
    assert_matches(r, r64, eager=re_, name="r")
    floor = _dx_terms(x.double() + res.double(), w, offset, dy, eps)
    for name, g, g64, ge in zip(("dx", "dresidual", "dw"), got, want, eager_grads):
        assert_matches(g, g64, eager=ge, name=name, scale_floor=floor if name != "dw" else 0.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("casting,offset", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(shape, casting, offset, dtype):
    _check_rms_norm(*_inputs(shape, dtype, casting), casting, offset, eps=_eps(shape))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("casting,offset", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(shape, casting, offset, dtype):
    x, w = _inputs(shape, dtype, casting)
    _check_add_rms_norm(x, torch.randn_like(x), w, casting, offset, eps=_eps(shape))


@pytest.mark.parametrize("path,shape", [("split_rows", (3, 127)), ("split_rows", (2, 300)), ("wide_rows", (3, 127)),
                                        ("wide_rows", (5, 250)), ("wide_rows", (2, 300))])
@pytest.mark.parametrize("casting,offset", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows(request, path, shape, casting, offset, dtype):
    request.getfixturevalue(path)  # the long-row backward under test: split column blocks or the wide kernel
    x, w = _inputs(shape, dtype, casting)
    _check_rms_norm(x, w, casting, offset)
    _check_add_rms_norm(x, torch.randn_like(x), w, casting, offset)


def test_wide_rows_strided(wide_rows):
    x = torch.randn(7, 260, device=DEVICE, dtype=torch.bfloat16)[:, 3:203]  # row stride 260, 4 chunks with a tail
    dy = torch.randn(200, 7, device=DEVICE, dtype=torch.bfloat16).t()  # a transposed incoming gradient
    w = _inputs((1, 200), torch.bfloat16, "llama")[1]
    _check_rms_norm(x, w, "llama", 0.0, dy=dy)
    _check_add_rms_norm(x, torch.randn(7, 200, device=DEVICE, dtype=torch.bfloat16), w, "gemma", 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_and_grads(dtype):
    # A column slice of a wider buffer (row stride ≠ N: used in place) and a transposed (T, B) → (B, T) view that
    # cannot collapse into rows (copied); incoming gradients are non-contiguous too.
    def column_slice(rows):
        return torch.randn(rows, 200, device=DEVICE, dtype=dtype)[:, 3:130]

    def transposed(b, t):
        return torch.randn(t, b, 127, device=DEVICE, dtype=dtype).transpose(0, 1)

    w = _inputs((1, 127), dtype, "llama")[1]
    _check_rms_norm(column_slice(6), w, "llama", 0.0, dy=column_slice(6))
    _check_rms_norm(transposed(3, 5), w, "gemma", 1.0, dy=transposed(3, 5))
    _check_add_rms_norm(column_slice(15), transposed(3, 5).reshape(15, 127), w, "llama", 0.0)
    _check_add_rms_norm(transposed(3, 5), column_slice(15).view(3, 5, 127), w, "gemma", 1.0)


@pytest.mark.parametrize("path", ["fused", "split_rows", "wide_rows"])
def test_strided_residual_grad(request, path):
    # r's incoming gradient can be a column slice of a wider buffer (r fed a torch.cat, whose backward hands out
    # narrow views): unit column stride, row stride != N. Every other check passes a contiguous dr, so a backward
    # that indexed it with dy's or x's row stride (or N) would pass them all.
    if path != "fused":
        request.getfixturevalue(path)
    x, w = _inputs((5, 200), torch.float32, "llama")
    dr = torch.randn(5, 333, device=DEVICE)[:, 7:207]
    assert dr.stride(0) != 200
    _check_add_rms_norm(x, torch.randn_like(x), w, "llama", 0.0, dr=dr)
    _check_add_rms_norm(x.bfloat16(), torch.randn_like(x).bfloat16(), w.bfloat16(), "gemma", 1.0, dr=dr.bfloat16())


def _assert_hf_bits(out, want, name):
    """bf16 ``out`` equals ``want`` bit for bit but for rare one-ulp ties (fp32 x̂ within an fp32 rounding of a
    bf16 rounding boundary; the GPU's approximate rsqrt adds a few): at most 1% of elements, each one ulp off."""
    assert out.dtype == want.dtype == torch.bfloat16
    off = out != want
    ulp = 2.0**-7 * want.float().abs()  # bf16 has 8 significant bits: one ulp is at most 2^-7 relative
    assert ((out.float() - want.float()).abs() <= ulp).all(), f"{name}: more than one bf16 ulp off"
    assert off.float().mean().item() <= 0.01, f"{name}: {off.float().mean().item():.1%} of elements differ from HF's"


@pytest.mark.parametrize("path", ["fused", "split_rows", "wide_rows"])
@pytest.mark.parametrize("casting,offset", MODES)
def test_bf16_rounding_points_match_hf(request, path, casting, offset):
    # Where the result is rounded is invisible to the float64 checks above: one extra or one missing bf16 rounding
    # of x̂ stays inside their tolerance. HF's points: llama rounds x̂ to bf16 before × w (so dW = Σ dy·bf16(x̂));
    # gemma rounds once, at the end (dW = Σ dy·x̂). Rebuilt in float64 here, the kernel's bits must match them.
    if path != "fused":
        request.getfixturevalue(path)
    x, w = _inputs((8, 250), torch.bfloat16, casting)
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    y = rms_norm(*leaves, 1e-6, offset=offset, casting=casting)
    dy = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, leaves[1], dy)
    x64 = x.double()
    xhat = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    if casting == "llama":
        xhat = xhat.to(torch.bfloat16).double()
    _assert_hf_bits(y, (xhat * (w.double() + offset)).to(torch.bfloat16), "y")
    _assert_hf_bits(dw, (dy.double() * xhat).sum(0).to(torch.bfloat16), "dw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_weight(dtype):
    # A weight that is a strided view (every other element of a buffer): the kernels index it with a unit stride.
    x, w = _inputs((5, 127), dtype, "llama")
    w_strided = torch.stack((w, torch.randn_like(w)), dim=1)[:, 0]
    assert w_strided.stride(0) == 2
    _check_rms_norm(x, w_strided, "llama", 0.0)
    _check_add_rms_norm(x, torch.randn_like(x), w_strided, "gemma", 1.0)


@pytest.mark.parametrize("incoming", ["constant", "graph"])
def test_double_backward_raises(incoming):
    # create_graph=True: the Triton backward is invisible to autograd, so its gradients must not pass for
    # differentiable ones (their second-order terms would silently be missing, even for a constant incoming grad).
    x, w = _inputs((3, 33), torch.float32, "llama")
    x, w, res = x.requires_grad_(), w.requires_grad_(), torch.randn_like(x).requires_grad_()
    for out in (rms_norm(x, w), add_rms_norm(x, res, w)[0]):
        loss = out.sum() if incoming == "constant" else out.pow(2).sum()
        with pytest.raises(RuntimeError, match="create_graph"):
            torch.autograd.grad(loss, (x, w), create_graph=True)


def test_residual_grad_when_one_output_is_unused():
    x, w = _inputs((4, 129), torch.float32, "llama")
    res = torch.randn_like(x)
    leaves = [t.detach().requires_grad_() for t in (x, res, w)]
    y, r = add_rms_norm(*leaves)
    dx, dres, dw = torch.autograd.grad(r.sum(), leaves)  # only r used: the norm contributes nothing
    torch.testing.assert_close(dx, torch.ones_like(x), rtol=0, atol=0)
    torch.testing.assert_close(dres, torch.ones_like(x), rtol=0, atol=0)
    assert (dw == 0).all()
    y, r = add_rms_norm(*leaves)
    dy = torch.randn_like(y)
    dx, dres, dw = torch.autograd.grad(y, leaves, dy)  # only y used: dx = dres = norm backward
    ref = [t.detach().double().requires_grad_() for t in (x, res, w)]
    dx64, _, dw64 = torch.autograd.grad(rms_norm_reference(ref[0] + ref[1], ref[2]), ref, dy.double())
    assert_matches(dx, dx64, name="dx")
    assert_matches(dres, dx64, name="dresidual")
    assert_matches(dw, dw64, name="dw")


def test_dw_is_deterministic():
    x, w = _inputs((37, 255), torch.bfloat16, "llama")
    dy = torch.randn_like(x)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (x, w)]
        runs.append(_grads(rms_norm(*leaves), leaves, dy))
    for a, b in zip(*runs):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_eps_is_honoured():
    x = torch.randn(3, 64, device=DEVICE) * 1e-3  # mean(x²) ~ 1e-6: eps dominates the result
    w = torch.ones(64, device=DEVICE)
    y_small, y_big = rms_norm(x, w, 1e-8), rms_norm(x, w, 1e-2)
    assert_matches(y_small, rms_norm_reference(x.double(), w.double(), 1e-8), name="eps=1e-8")
    assert_matches(y_big, rms_norm_reference(x.double(), w.double(), 1e-2), name="eps=1e-2")
    assert y_big.abs().max() < 0.1 < y_small.abs().max()


@pytest.mark.parametrize("casting,offset", MODES)
def test_module(casting, offset):
    m = RMSNorm(96, eps=1e-5, offset=offset, casting=casting, device=DEVICE, dtype=torch.bfloat16)
    assert list(m.state_dict()) == ["weight"]
    assert torch.equal(m.weight, torch.full_like(m.weight, 0.0 if casting == "gemma" else 1.0))
    with torch.no_grad():
        m.weight.normal_(mean=0.0 if casting == "gemma" else 1.0, std=0.3)
    x = torch.randn(2, 5, 96, device=DEVICE, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    torch.testing.assert_close(m(x), rms_norm(x, m.weight, 1e-5, offset=offset, casting=casting), rtol=0, atol=0)
    y, r = m(x, res)
    y_ref, r_ref = add_rms_norm(x, res, m.weight, 1e-5, offset=offset, casting=casting)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    m(x, res)[0].float().sum().backward()
    assert m.weight.grad is not None and m.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("casting,offset", [*MODES, ("gemma", 0.0), ("llama", 1.0)])
def test_fresh_module_has_unit_scale(casting, offset):
    # A new RMSNorm scales x̂ by offset + w = 1 in every mode, not only in the two pairings the models use.
    m = RMSNorm(33, eps=1e-5, offset=offset, casting=casting, device=DEVICE)
    x = torch.randn(4, 33, device=DEVICE)
    ones = torch.ones(33, dtype=torch.float64, device=DEVICE)
    assert_matches(m(x), rms_norm_reference(x.double(), ones, 1e-5), name="y")


def test_llama_forward_matches_hf_numerics_bitwise():
    # bf16 x and w: HF rounds x̂ to bf16 and multiplies in bf16; the kernel's fp32 product rounded once is the same.
    x, w = _inputs((8, 512), torch.bfloat16, "llama")
    y, y_eager = rms_norm(x, w), rms_norm_reference(x, w)
    assert (y.float() - y_eager.float()).abs().max() <= 2 ** -6 * y_eager.float().abs().max()


def test_reference_path_when_not_interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = (t.cpu() for t in _inputs((3, 33), torch.float32, "gemma"))  # CPU tensors on a GPU machine too
    xr = x.clone().requires_grad_()
    y = rms_norm(xr, w, offset=1.0, casting="gemma")
    assert torch.equal(y, rms_norm_reference(x, w, 1e-6, 1.0, "gemma"))
    y.sum().backward()
    assert xr.grad is not None


def test_empty_rows():
    x, w = torch.randn(0, 16, device=DEVICE), torch.ones(16, device=DEVICE, requires_grad=True)
    y = rms_norm(x.requires_grad_(), w)
    y.sum().backward()
    assert y.shape == (0, 16) and (w.grad == 0).all()


def test_bad_inputs():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, torch.ones(8, device=DEVICE), casting="olmo")
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(x, torch.randn(2, 9, device=DEVICE), torch.ones(8, device=DEVICE))
    with pytest.raises(TypeError, match="floating-point"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64, device=DEVICE), torch.ones(8, device=DEVICE))
    with pytest.raises(TypeError, match="weight tensor"):
        add_rms_norm(x, torch.randn_like(x), None)


def test_launch_helpers_match_triton():
    # liger_models/kernels/_launch.py: plain-Python integer helpers, and a compiled-kernel cache key at least as fine as the
    # specialisation Triton itself computes (else a cached binary could run on arguments it was not built for).
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from liger_models.kernels._launch import _key, _spec, cdiv, pow2

    for n in (1, 2, 3, 4, 5, 127, 1023, 1024, 1025, 2**31 + 1):
        assert pow2(n) == triton.next_power_of_2(n) and cdiv(n, 7) == triton.cdiv(n, 7)
    buf = torch.empty(64, dtype=torch.bfloat16)
    samples = [buf, buf[1:], buf[8:], buf.float(), None, 0, 1, 2, 16, 17, 32, 2**31 - 16, 2**31, 2**31 + 16, -16, 0.5]
    for a in samples:
        for b in samples:
            if _key(rn._norm_fwd_kernel, 0, _spec([a])[0], {}) == _key(rn._norm_fwd_kernel, 0, _spec([b])[0], {}):
                assert (native_specialize_impl(CUDABackend, a, False, True, True)
                        == native_specialize_impl(CUDABackend, b, False, True, True)), (a, b)


# ----------------------------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (4096, 8192), (1024, 65536), (8192, 16384), (3000, 12000),
                                   (4095, 2047)])
@pytest.mark.parametrize("casting,offset", MODES)
def test_gpu_real_sizes(shape, casting, offset):
    x, w = _inputs(shape, torch.bfloat16, casting)
    _check_rms_norm(x, w, casting, offset)
    _check_add_rms_norm(x, torch.randn_like(x), w, casting, offset)


@pytest.mark.gpu
def test_gpu_fp32_and_strided():
    x, w = _inputs((8192, 4096), torch.float32, "llama")
    _check_rms_norm(x, w, "llama", 0.0)
    wide = torch.randn(4096, 5000, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16).t()  # a transposed incoming gradient
    _check_rms_norm(wide[:, 17:4113], w.bfloat16(), "llama", 0.0, dy=dy)
    _check_add_rms_norm(wide[:, 17:4113], wide[:, 900:4996], w.bfloat16(), "gemma", 1.0)


@pytest.mark.gpu
def test_gpu_dw_is_deterministic():
    x, w = _inputs((16384, 4096), torch.bfloat16, "llama")
    dy = torch.randn_like(x)
    runs = []
    for _ in range(3):
        leaves = [t.detach().requires_grad_() for t in (x, w)]
        runs.append(_grads(rms_norm(*leaves), leaves, dy)[1])
    assert all(torch.equal(runs[0].view(torch.int16), r.view(torch.int16)) for r in runs[1:])


@pytest.mark.gpu
@BIG_MEMORY
def test_gpu_more_than_2_31_elements():
    n_cols = 4096
    n_rows = 2**31 // n_cols + 7  # ≈ 4.3 GB of bf16: offsets past 2³¹ elements need int64
    x = torch.randn(n_rows, n_cols, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n_cols, device=DEVICE) * 0.5 + 1).bfloat16().requires_grad_()
    xr = x.requires_grad_()
    y = rms_norm(xr, w)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (xr, w), dy)
    dw64 = torch.zeros(n_cols, device=DEVICE, dtype=torch.float64)
    chunk = 1 << 16
    for s in range(0, n_rows, chunk):  # the last chunk holds the rows past element 2³¹
        rows = slice(s, min(s + chunk, n_rows))
        xc = x[rows].detach().double().requires_grad_()
        wc = w.detach().double().requires_grad_()
        yc = rms_norm_reference(xc, wc)
        dxc, dwc = torch.autograd.grad(yc, (xc, wc), dy[rows].double())
        assert_matches(y[rows], yc, name=f"y rows {rows}")
        assert_matches(dx[rows], dxc, name=f"dx rows {rows}")
        dw64 += dwc
    assert_matches(dw, dw64, name="dw")
