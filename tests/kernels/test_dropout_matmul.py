"""LoRA's thin products with the dropout mask drawn inside (kernels/ops/dropout_matmul.py), against float64 products
of the masks each draw gives (``DropoutDraw.mask``, the elementwise kernel's): forward drop_i(x)·A_iᵀ, dX's
out + Σ_i drop_i(d_i·A_i) and dA's d_iᵀ·drop_i(x), for groups of one to six adapters (a launch takes four), mixed
rates (zero among them), odd shapes, a row-strided input and outputs poisoned before the call. Bounds per dtype: the
roundings the kernel is documented to make (the dropped input to the dtype, fp32 sums, one final rounding)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from liger_models.kernels._dispatch import reference_mode
from liger_models.kernels.ops import dropout as dr
from liger_models.kernels.ops import dropout_matmul as dm
from tests.helpers import DEVICE, poison_

# (tokens, columns, ranks, rates)
CASES = [
    (37, 130, [8, 16, 5], [0.1, 0.3, 0.0]),  # q|k|v-like, one without dropout, columns past the last block
    (70, 64, [16], [0.5]),
    (5, 9, [4, 1, 3, 2, 6, 5], [0.2, 0.25, 0.3, 0.35, 0.4, 0.45]),  # two launches (four adapters a launch)
    (129, 200, [32, 32], [0.05, 0.05]),  # gate|up-like
]
# The output's rounding to the dtype (its unit roundoff: half a unit in the last place, relative), fp32 sums of the terms
ROUND = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
SUMS = 2.0**-21


@contextlib.contextmanager
def _poisoned_empty(monkeypatch):
    """Every torch.empty inside comes back poisoned (the kernels' outputs and scratch); only this patch is undone
    after (conftest's interpreter rounding fix stays)."""
    real = torch.empty
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", lambda *args, **kwargs: poison_(real(*args, **kwargs)))
        yield


def _inputs(n, k, ranks, dtype, strided=False):
    x = torch.randn(n, k + 7 if strided else k, device=DEVICE).to(dtype)
    x = x[:, 3:3 + k] if strided else x
    a = torch.randn(sum(ranks), k, device=DEVICE).to(dtype)
    d = torch.randn(n, sum(ranks), device=DEVICE).to(dtype)
    return x, a, d


def _keeps(draws, n, k):
    """Per adapter: the float64 factor keep / (1 − p) (ones without dropout), and the fp32 scale the kernel uses."""
    out = []
    for draw in draws:
        if draw is None:
            out.append((torch.ones(n, k, dtype=torch.float64, device=DEVICE), 1.0))
        else:
            scale = torch.tensor(1 / (1 - draw.p), dtype=torch.float32).item()
            out.append((draw.mask().double(), scale))
    return out


def _dropped(x, mask, scale):
    """drop(x) as the kernel forms it: x · fp32 scale in fp32, rounded once to x's dtype (float64 after)."""
    return torch.where(mask.bool(), x.float() * scale, 0.0).to(x.dtype).double()


# A launch's summed rank: the default, and a cap that splits every case's group into more launches
LAUNCH_RANKS = [dm.MAX_LAUNCH_RANK, 20]


@pytest.mark.parametrize("launch_rank", LAUNCH_RANKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, ranks, rates", CASES)
def test_forward_is_each_adapters_dropped_input_times_its_A(n, k, ranks, rates, dtype, launch_rank, monkeypatch):
    monkeypatch.setattr(dm, "MAX_LAUNCH_RANK", launch_rank)
    x, a, _ = _inputs(n, k, ranks, dtype, strided=True)
    draws = dr.draws_for(x, rates)
    assert draws.seeded
    with _poisoned_empty(monkeypatch):
        got = dm.dropped_matmul(x, a, ranks, draws)
    parts, bounds = [], []
    for a_i, (mask, scale) in zip(a.split(ranks), _keeps(draws, n, k)):
        xi = _dropped(x, mask, scale)
        parts.append(xi @ a_i.double().t())
        bounds.append(xi.abs() @ a_i.double().abs().t())
    ref, size = torch.cat(parts, 1), torch.cat(bounds, 1)
    assert got.dtype == dtype and got.shape == ref.shape
    assert ((got.double() - ref).abs() <= ROUND[dtype] * ref.abs() + SUMS * size).all()


@pytest.mark.parametrize("launch_rank", LAUNCH_RANKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, ranks, rates", CASES)
def test_dx_adds_each_adapters_dropped_product_and_rounds_once(n, k, ranks, rates, dtype, launch_rank, monkeypatch):
    monkeypatch.setattr(dm, "MAX_LAUNCH_RANK", launch_rank)
    x, a, d = _inputs(n, k, ranks, dtype)
    draws = dr.draws_for(x, rates)
    out = torch.randn(n, k, device=DEVICE).to(dtype)
    ref, size = out.double().clone(), out.double().abs()
    for d_i, a_i, (mask, scale) in zip(d.split(ranks, 1), a.split(ranks), _keeps(draws, n, k)):
        ref += (d_i.double() @ a_i.double()) * mask * scale
        size += (d_i.double().abs() @ a_i.double().abs()) * mask * scale
    got = dm.dropped_matmul_add(out, d, a, ranks, draws)
    assert got is out
    launches = len(dm._launch_groups(ranks))  # each rounds its running sum once
    assert ((got.double() - ref).abs() <= ROUND[dtype] * (ref.abs() + (launches - 1) * size) + SUMS * size).all()


@pytest.mark.parametrize("launch_rank", LAUNCH_RANKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, ranks, rates", CASES)
def test_dA_is_each_adapters_gradient_against_its_dropped_input_in_fp32(n, k, ranks, rates, dtype, launch_rank,
                                                                        monkeypatch, tune):
    monkeypatch.setattr(dm, "MAX_LAUNCH_RANK", launch_rank)
    x, a, d = _inputs(n, k, ranks, dtype, strided=True)
    draws = dr.draws_for(x, rates)
    parts, bounds = [], []
    for d_i, (mask, scale) in zip(d.split(ranks, 1), _keeps(draws, n, k)):
        xi = _dropped(x, mask, scale)
        parts.append(d_i.double().t() @ xi)
        bounds.append(d_i.double().abs().t() @ xi.abs())
    ref, size = torch.cat(parts), torch.cat(bounds)
    for split in (1, 3):  # the tokens in one program, and split over several (partial sums added after)
        tune(dm, t_block_m=16, t_programs_per_sm=split)
        with _poisoned_empty(monkeypatch):
            got = dm.dropped_matmul_t(d, x, ranks, draws)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert ((got.double() - ref).abs() <= 2.0**-24 * ref.abs() + SUMS * size).all(), split


def test_launches_take_consecutive_adapters_up_to_four_and_the_rank_cap():
    assert dm._launch_groups([16, 16, 16]) == [[0, 1, 2]]
    assert dm._launch_groups([4] * 6) == [[0, 1, 2, 3], [4, 5]]
    assert dm._launch_groups([200, 100, 8, 300]) == [[0], [1, 2], [3]]  # one adapter past the cap runs alone


def test_each_adapter_uses_its_own_mask():
    """Adapters with the same rate over the same input draw different masks, and the kernels use each one's: giving
    every adapter the first one's seed changes the products."""
    x, a, d = _inputs(64, 96, [16, 16], torch.float32)
    draws = dr.draws_for(x, [0.5, 0.5])
    assert not torch.equal(draws[0].mask(), draws[1].mask())
    own = dm.dropped_matmul(x, a, [16, 16], draws)
    draws.seeds[1] = draws.seeds[0]
    shared = dm.dropped_matmul(x, a, [16, 16], draws)
    assert torch.equal(own[:, :16], shared[:, :16]) and not torch.allclose(own[:, 16:], shared[:, 16:])


def test_the_reference_path_applies_stored_masks():
    """Where a draw stores its mask (reference mode), the three products are the whole-tensor PyTorch ones."""
    x, a, d = _inputs(20, 33, [4, 8], torch.float32)
    with reference_mode():
        draws = dr.draws_for(x, [0.3, 0.0])
        assert not draws.seeded and draws[0].stored is not None and draws[1] is None
        keep = draws[0].stored.double() / 0.7
        xa = dm.dropped_matmul(x, a, [4, 8], draws)
        out = torch.zeros(20, 33)
        dm.dropped_matmul_add(out, d, a, [4, 8], draws)
        dA = dm.dropped_matmul_t(d, x, [4, 8], draws)
    xd = x.double()
    torch.testing.assert_close(xa.double(), torch.cat([(xd * keep) @ a[:4].double().t(), xd @ a[4:].double().t()], 1),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), (d[:, :4].double() @ a[:4].double()) * keep
                               + d[:, 4:].double() @ a[4:].double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dA.double(), torch.cat([d[:, :4].double().t() @ (xd * keep),
                                                      d[:, 4:].double().t() @ xd]), rtol=1e-5, atol=1e-5)


def test_bad_calls_are_refused_by_name():
    x, a, d = _inputs(8, 16, [4], torch.float32)
    draws = dr.draws_for(x, [0.1])
    with pytest.raises(ValueError, match="1 dropout draws for 2 adapters"):
        dm.dropped_matmul(x, torch.cat([a, a]), [4, 4], draws)
    with pytest.raises(ValueError, match="unit column stride"):
        dm.dropped_matmul_t(d, x.t().contiguous().t(), [4], draws)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_at_lora_widths(dtype):
    """Compiled, at a Llama-3.1-8B step's shapes: 8192 tokens, q|k|v (4096 columns, r = 16 each) and down (14336)."""
    for k, ranks in ((4096, [16, 16, 16]), (14336, [16])):
        n = 8192
        x, a, d = _inputs(n, k, ranks, dtype)
        draws = dr.draws_for(x, [0.1] * len(ranks))
        keeps = _keeps(draws, n, k)
        got = dm.dropped_matmul(x, a, ranks, draws)
        for j, (a_i, (mask, scale)) in enumerate(zip(a.split(ranks), keeps)):
            xi = _dropped(x, mask, scale)
            ref, size = xi @ a_i.double().t(), xi.abs() @ a_i.double().abs().t()
            lo = sum(ranks[:j])
            assert ((got[:, lo:lo + ranks[j]].double() - ref).abs() <= ROUND[dtype] * ref.abs() + SUMS * size).all()
        dA = dm.dropped_matmul_t(d, x, ranks, draws)
        lo = 0
        for d_i, (mask, scale) in zip(d.split(ranks, 1), keeps):
            xi = _dropped(x, mask, scale)
            ref, size = d_i.double().t() @ xi, d_i.double().abs().t() @ xi.abs()
            assert ((dA[lo:lo + d_i.shape[1]].double() - ref).abs() <= 2.0**-24 * ref.abs() + SUMS * size).all()
            lo += d_i.shape[1]
        out = torch.randn(n, k, device=DEVICE).to(dtype)
        ref, size = out.double().clone(), out.double().abs()
        for d_i, a_i, (mask, scale) in zip(d.split(ranks, 1), a.split(ranks), keeps):
            ref += (d_i.double() @ a_i.double()) * mask * scale
            size += (d_i.double().abs() @ a_i.double().abs()) * mask * scale
        got = dm.dropped_matmul_add(out, d, a, ranks, draws)
        assert ((got.double() - ref).abs() <= ROUND[dtype] * ref.abs() + SUMS * size).all()
