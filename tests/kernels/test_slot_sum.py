"""slot_sum (the MoE combine: out[t] = Σ_j w[t, j] · rows[pos[t, j]]) against a float64 sum of the products rounded
as torch rounds them, for every dtype pairing the MoE layer uses, odd widths, strided rows and repeated positions."""

import pytest
import torch

from liger_models.kernels._dispatch import reference_mode
from liger_models.kernels.ops import slot_sum as ss
from tests.helpers import DEVICE

CASES = [  # rows dtype, weights dtype (None: a plain sum), output dtype
    (torch.bfloat16, torch.float32, torch.bfloat16),  # Mixtral's forward
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # Qwen3-MoE's forward
    (torch.bfloat16, None, torch.bfloat16),  # the input gradient in backward
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32),  # an output finer than the product: the sum rounded first
]


def _expected(rows, positions, weights, out_dtype):
    """(the products rounded to torch's promoted dtype, summed in float64, rounded to that dtype, then cast; the sum
    of the products' magnitudes; the product dtype)."""
    gathered = rows[positions.reshape(-1)].view(*positions.shape, rows.shape[1])
    product_dtype = rows.dtype if weights is None else torch.promote_types(rows.dtype, weights.dtype)
    if weights is not None:
        gathered = (gathered.float() * weights.float()[..., None]).to(product_dtype)
    terms = gathered.double()
    return (terms.sum(dim=1).to(product_dtype).to(out_dtype).double(), terms.abs().sum(dim=1), product_dtype)


@pytest.fixture(autouse=True)
def fused(tune):
    """The kernel (the default, set here so a LIGER_TUNE run does not move it); tests of the PyTorch passes switch it
    off."""
    tune(ss, fused=True)


def _check(n_tokens, top_k, width, rows_dtype, w_dtype, out_dtype, strided=False, repeated=False):
    n_rows = n_tokens * top_k
    wide = torch.randn(n_rows, width + (5 if strided else 0), device=DEVICE).to(rows_dtype)
    rows = wide[:, 2:width + 2] if strided else wide
    if repeated:  # any gather, not only a permutation: rows read by several tokens, some by none
        positions = torch.randint(0, n_rows, (n_tokens, top_k), device=DEVICE)
    else:
        positions = torch.randperm(n_rows, device=DEVICE).view(n_tokens, top_k)
    weights = None if w_dtype is None else torch.rand(n_tokens, top_k, device=DEVICE).to(w_dtype)
    out = ss.slot_sum(rows, positions, weights, out_dtype)
    expected, magnitude, product_dtype = _expected(rows, positions, weights, out_dtype)
    assert out.dtype == out_dtype and out.shape == (n_tokens, width)
    # The fp32 sum of k terms is off by at most k fp32 roundings of the terms' magnitude, and its rounding to the
    # coarser of the product's and the output's dtypes may then land on the other neighbour of the exact sum's: one
    # ulp there (bf16 rows with fp32 weights: an fp32 sum rounded to a bf16 output, CI seed 789298833).
    final = min(product_dtype, out_dtype, key=lambda d: torch.finfo(d).bits)
    bound = (torch.finfo(final).eps * expected.abs() + top_k * torch.finfo(torch.float32).eps * magnitude
             + torch.finfo(final).tiny)
    err = (out.double() - expected).abs()
    assert bool((err <= bound).all()), (err / bound).max().item()
    return out


@pytest.mark.parametrize("rows_dtype, w_dtype, out_dtype", CASES)
@pytest.mark.parametrize("n_tokens, top_k, width", [(1, 1, 1), (7, 2, 5), (13, 8, 1023), (3, 3, 4097)])
def test_slot_sum_equals_the_rounded_float64_sum(n_tokens, top_k, width, rows_dtype, w_dtype, out_dtype):
    _check(n_tokens, top_k, width, rows_dtype, w_dtype, out_dtype)


@pytest.mark.parametrize("repeated", [False, True], ids=["permutation", "repeated"])
def test_slot_sum_strided_rows(repeated):
    _check(11, 4, 130, torch.bfloat16, torch.float32, torch.bfloat16, strided=True, repeated=repeated)


def test_slot_sum_reference_and_unfused_forms_agree(tune):
    # The PyTorch passes (reference mode, or the kernel switched off for bench_moe) meet the same bound.
    with reference_mode():
        _check(9, 2, 33, torch.bfloat16, torch.float32, torch.bfloat16)
    tune(ss, fused=False)
    _check(9, 8, 33, torch.bfloat16, torch.bfloat16, torch.bfloat16)


def test_slot_sum_block_smaller_than_the_row(tune):
    tune(ss, block=16)  # a row spread over several programs, the last one partly masked
    _check(5, 2, 45, torch.bfloat16, torch.float32, torch.bfloat16)


def test_slot_sum_empty():
    rows = torch.randn(0, 6, device=DEVICE)
    out = ss.slot_sum(rows, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows_dtype, w_dtype, out_dtype", CASES)
@pytest.mark.parametrize("n_tokens, top_k, width", [(1031, 2, 4096), (517, 8, 2048), (3, 3, 4097)])
def test_gpu_slot_sum_at_the_moe_widths(n_tokens, top_k, width, rows_dtype, w_dtype, out_dtype):
    # Compiled, at Mixtral-8x7B's (D 4096, top 2) and Qwen3-30B-A3B's (D 2048, top 8) widths and an odd one.
    _check(n_tokens, top_k, width, rows_dtype, w_dtype, out_dtype)
    _check(n_tokens, top_k, width, rows_dtype, w_dtype, out_dtype, strided=True, repeated=True)
