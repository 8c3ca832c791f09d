"""Dropout drawn from a seed (kernels/ops/dropout.py), LoRA's dropout on an adapter's input: kept values equal the
input times 1 / (1 − p) rounded once, the rest zero; the mask is a function of the seed and each element's logical
(row, column) index only, so forward and backward draw the same one; the kept fraction is 1 − p; the accumulating form
adds into its output; bad calls are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from liger_models.kernels._dispatch import reference_mode
from liger_models.kernels.ops import dropout as dr
from tests.helpers import DEVICE, poison_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _seed() -> torch.Tensor:
    return dr.new_seeds(1, torch.device(DEVICE))


def _expected(t: torch.Tensor, mask: torch.Tensor, p: float, base: torch.Tensor | None = None) -> torch.Tensor:
    """t · fp32(1 / (1 − p)) where kept (+ base), each step in fp32, rounded once to t's dtype: an elementwise
    product, so the kernel must give these bits (themselves within fp32's roundings of float64's, checked too)."""
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    y = torch.where(mask, t.float() * scale, 0.0)
    if base is not None:
        y = y + base.float()
    term = t.double() * mask.double() / (1 - p)
    exact, size = (term, term.abs()) if base is None else (term + base.double(), term.abs() + base.double().abs())
    assert ((y.double() - exact).abs() <= 2.0**-22 * size).all()  # the scale's, the product's and the sum's roundings
    return y.to(t.dtype)


def _check(rows: int, cols: int, dtype: torch.dtype, p: float) -> None:
    t = torch.randn(rows, cols, device=DEVICE).to(dtype)
    seed = _seed()
    out = poison_(torch.empty_like(t))
    dr.seeded_dropout(t, seed, p, out=out)
    mask = dr.seeded_dropout(torch.ones(rows, cols, device=DEVICE), seed, p) != 0
    # Kept exactly where the mask is (the mask from ones, so a zero in t cannot hide a drop), rounded once.
    assert torch.equal(out, _expected(t, mask, p))
    assert torch.equal(dr.seeded_dropout(t, seed, p), out)  # the same seed draws the same mask
    n = rows * cols
    kept = mask.double().mean().item()
    # the rate at 16-bit resolution: kept with chance 1 − round(p · 2¹⁶) / 2¹⁶
    assert abs(kept - (1 - p)) <= 5 * (p * (1 - p) / n) ** 0.5 + 2.0**-17, (kept, 1 - p)


def _philox_4x32_10(seed: int, counters: np.ndarray) -> list[np.ndarray]:
    """Philox-4x32-10 (Salmon et al., 2011) of counters (c0, c1) = (low, high words of each int64 counter), c2 = c3
    = 0, key = the seed's two words: the four uint32 outputs, in numpy's exact uint64 arithmetic."""
    mask32 = np.uint64(0xFFFFFFFF)
    c = [counters.astype(np.uint64) & mask32, counters.astype(np.uint64) >> np.uint64(32),
         np.zeros(counters.shape, np.uint64), np.zeros(counters.shape, np.uint64)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    mult_a, mult_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        prod_b, prod_a = mult_b * c[2], mult_a * c[0]  # exact: both factors below 2³²
        c = [(prod_b >> np.uint64(32)) ^ c[1] ^ k0, prod_b & mask32,
             (prod_a >> np.uint64(32)) ^ c[3] ^ k1, prod_a & mask32]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask32, (k1 + np.uint64(0xBB67AE85)) & mask32
    return c


def _draws(seed: torch.Tensor, rows: int, cols: int) -> np.ndarray:
    """u(row, col): the low (col even) or high (col odd) 16 bits of output (col % 8) // 2 of
    Philox(seed, row · ⌈cols / 8⌉ + col // 8), computed in numpy from the definition."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    outputs = _philox_4x32_10(int(seed.item()), r * -(-cols // 8) + c // 8)
    return (np.choose((c % 8) // 2, outputs) >> (16 * (c % 2)).astype(np.uint64)) & np.uint64(0xFFFF)


def test_the_mask_is_philox_of_the_documented_counters():
    """keep(row, col) = u ≥ round(p · 2¹⁶) with u the documented 16-bit draw (``_draws``): the elementwise kernel
    and every product kernel draw this one mask."""
    rows, cols, p = 6, 37, 0.35
    seed = _seed()
    mask = dr.seeded_dropout(torch.ones(rows, cols, device=DEVICE), seed, p) != 0
    assert dr.keep_threshold(p) == 22938  # 0.35 · 65536 = 22937.6
    assert torch.equal(mask.cpu(), torch.from_numpy(_draws(seed, rows, cols) >= 22938))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols, p", [(1, 1, 0.5), (3, 2049, 0.1), (37, 96, 0.3), (128, 700, 0.9)])
def test_kept_values_are_the_input_scaled_and_the_fraction_is_one_minus_p(rows, cols, p, dtype):
    _check(rows, cols, dtype, p)


def test_the_mask_follows_the_logical_index_not_the_layout(tune):
    """A row-strided input, a narrow column block (several programs per row) and the default: one mask; another
    seed draws another; accumulate adds into a strided output."""
    wide = torch.randn(19, 300, device=DEVICE)
    t, seed, p = wide[:, 7:7 + 250], _seed(), 0.4
    dense = dr.seeded_dropout(t.contiguous(), seed, p)
    assert torch.equal(dr.seeded_dropout(t, seed, p), dense)
    tune(dr, block_rows=2, block_cols=64)
    assert torch.equal(dr.seeded_dropout(t, seed, p), dense)
    other = dr.seeded_dropout(t.contiguous(), _seed(), p)
    assert not torch.equal((other != 0), (dense != 0))
    target = torch.randn(19, 260, device=DEVICE)
    base = target.clone()
    window = target[:, 3:253]
    dr.seeded_dropout(t, seed, p, out=window, accumulate=True)
    mask = dr.seeded_dropout(torch.ones_like(dense), seed, p) != 0
    assert torch.equal(window, _expected(t, mask, p, base[:, 3:253]))
    assert torch.equal(target[:, :3], base[:, :3]) and torch.equal(target[:, 253:], base[:, 253:])


def test_a_draw_keeps_a_seed_and_gives_the_same_mask_to_every_use():
    x = torch.randn(33, 80, device=DEVICE).to(torch.bfloat16)
    draw = dr.DropoutDraw(x, 0.25)
    assert draw.stored is None and draw.seed.shape == (1,) and draw.seed.dtype == torch.int64
    mask = draw.mask()
    assert torch.equal(draw.apply(x), _expected(x, mask, 0.25))
    g = torch.randn(33, 80, device=DEVICE).to(torch.bfloat16)
    acc = torch.randn(33, 80, device=DEVICE).to(torch.bfloat16)
    expected = _expected(g, mask, 0.25, acc)
    assert torch.equal(draw.apply(g, out=acc, accumulate=True), expected)
    with pytest.raises(ValueError, match=r"this dropout mask is \(33, 80\), got a tensor of \(33, 81\)"):
        draw.apply(torch.randn(33, 81, device=DEVICE))


def test_reference_mode_stores_the_mask_and_draws_from_torchs_generator():
    x = torch.randn(64, 48, device=DEVICE)
    with reference_mode():
        torch.manual_seed(3)
        draw = dr.DropoutDraw(x, 0.5)
        torch.manual_seed(3)
        expected = torch.empty_like(x, dtype=torch.bool).bernoulli_(0.5)
        assert draw.seed is None and torch.equal(draw.mask(), expected)
        assert torch.equal(draw.apply(x), x * expected * 2.0)


def test_the_rate_is_applied_at_16_bit_resolution():
    """T = round(p · 2¹⁶): a rate under 2⁻¹⁷ keeps everything (still scaled by 1 / (1 − p)), p = 1 − 2⁻¹⁶ keeps
    exactly the draws of 0xFFFF, one within 2⁻¹⁷ of 1 keeps nothing."""
    assert [dr.keep_threshold(p) for p in (2.0**-18, 0.1, 0.5, 1 - 2.0**-18)] == [0, 6554, 32768, 65536]
    rows, cols = 300, 1000
    t = torch.randn(rows, cols, device=DEVICE)
    seed = _seed()
    p = 2.0**-18
    assert torch.equal(dr.seeded_dropout(t, seed, p), _expected(t, torch.ones_like(t, dtype=torch.bool), p))
    top = dr.seeded_dropout(torch.ones_like(t), seed, 1 - 2.0**-16) != 0
    assert torch.equal(top.cpu(), torch.from_numpy(_draws(seed, rows, cols) == 0xFFFF))
    assert not dr.seeded_dropout(torch.ones_like(t), seed, 1 - 2.0**-18).any()


def test_float64_stores_its_mask():
    """The kernels compute in fp32, so a float64 input takes the reference path (a stored mask), exact in float64."""
    x = torch.randn(16, 40, device=DEVICE, dtype=torch.float64)
    draw = dr.DropoutDraw(x, 0.3)
    assert draw.seed is None and draw.stored is not None
    assert torch.equal(draw.apply(x), x * draw.stored * (1 / (1 - 0.3)))


def test_torch_manual_seed_fixes_the_kernels_mask():
    x = torch.randn(16, 64, device=DEVICE)
    torch.manual_seed(11)
    first = dr.DropoutDraw(x, 0.3).mask()
    torch.manual_seed(11)
    assert torch.equal(dr.DropoutDraw(x, 0.3).mask(), first)


def test_bad_calls_are_refused_by_name():
    seed = _seed()
    with pytest.raises(ValueError, match="2-D tensor with unit column stride"):
        dr.seeded_dropout(torch.randn(4, 6, device=DEVICE).t(), seed, 0.1)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        dr.seeded_dropout(torch.randn(4, 6, device=DEVICE), seed, 1.0)
    with pytest.raises(ValueError, match="accumulate=True needs"):
        dr.seeded_dropout(torch.randn(4, 6, device=DEVICE), seed, 0.1, accumulate=True)
    with pytest.raises(ValueError, match="out must be"):
        dr.seeded_dropout(torch.randn(4, 6, device=DEVICE), seed, 0.1, out=torch.empty(4, 6, dtype=torch.float16,
                                                                                          device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_at_lora_widths(dtype):
    """Compiled, at a Llama-3.1-8B step's adapter inputs (8192 tokens × 4096 and × 14336)."""
    for cols in (4096, 14336):
        _check(8192, cols, dtype, 0.05)
