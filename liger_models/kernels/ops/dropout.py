"""Dropout whose mask is drawn again instead of stored: LoRA's dropout on an adapter's input.

Math: drop(t) = t · keep / (1 − p), keep = u ≥ T with u uniform on the 16-bit integers and T = round(p · 2¹⁶): the
rate is applied at 16-bit resolution, |T / 2¹⁶ − p| ≤ 2⁻¹⁷, and a kept value is scaled by nn.Dropout's 1 / (1 − p)
(in fp32, rounded once). PEFT applies ``nn.Dropout`` to the input of every adapter, independently per adapter,
and the adapter's backward needs the same mask twice more: for dA (drop(x) itself) and for dX (the mask times the
gradient). Stored, the mask is one byte per input element per adapter (q, k and v each draw their own: 6·H + I bytes
a token a layer at Llama widths, more than the layer's checkpoint). Here u is a function of a seed and the element's
index: one call of Philox-4x32-10 (Triton's ``tl.randint4x``: four 32-bit outputs) with counter
row · ⌈cols / 8⌉ + col // 8 gives the draws of eight neighbouring columns, u(row, col) being the low (even col) or
high (odd col) half of output (col % 8) // 2. So forward and backward each draw the mask where they need it, and what
is kept between them is the seed: one int64 on the device, drawn from torch's generator on that device (so
``torch.manual_seed`` fixes it, activation checkpointing's restored RNG state draws it again, and a CUDA-graph capture
replays a fresh one every step). A Philox call is about 60 integer operations, 20 of them wide multiplies, and that
work is most of what a mask adds to a product, so a call serves eight columns, 16 bits each, where a 32-bit uniform
each would serve four: with half the calls, one adapter's mask over 8192 × 4096 added 0.021 ms to o's forward
product instead of 0.031, and q|k|v's three masks 0.143 instead of 0.216, so about two thirds of it was the calls
(H100, 2026-12-07, BENCHMARKS.md "LoRA / QLoRA training step").
FlashAttention's dropout takes 8 bits an element; 16 keep the rate within 2⁻¹⁷ of the one asked for.

The LoRA products that use the mask draw it inside their own kernels (kernels/ops/dropout_matmul.py, with
``keep_mask`` below); ``seeded_dropout`` is the same mask as an elementwise pass.

``DropoutDraw`` holds one adapter's draw for one forward: the seed where the kernel runs (CUDA, Triton's
interpreter), else the bool mask itself (``seeded_dropout_reference``'s PyTorch path: the same distribution, other
numbers, as PyTorch's own generator draws them). ``mask()`` gives the bool mask of either kind (for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import use_triton
from .._launch import cdiv, launch


@dataclass(frozen=True)
class DropoutTuning:
    """Launch settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # The elementwise pass (one read and one write an element, two reads with accumulate); not swept. The LoRA step
    # draws its masks inside dropout_matmul's kernels instead (BENCHMARKS.md, "LoRA / QLoRA training step").
    block_rows: int = 4
    block_cols: int = 512  # a multiple of 8 (the columns of one Philox call start at a multiple of 8)
    num_warps: int = 4


TUNING = DropoutTuning()


@triton.jit
def keep_mask(seed, rows, col0, n_cols, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool, whether element (rows[i], col0 + j) is kept: u ≥ threshold (``keep_threshold``),
    where u(row, col) is the low (col even) or high (col odd) 16 bits of output (col % 8) // 2 of
    Philox(seed, row · ⌈n_cols / 8⌉ + col // 8). ``rows`` int64 [BLOCK_M]; col0 and BLOCK_N multiples of 8 (a call's
    eight columns in one tile); columns past n_cols come out arbitrary (callers mask them)."""
    octets = (n_cols + 7) // 8
    counters = rows[:, None] * octets + (col0 // 8 + tl.arange(0, BLOCK_N // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)
    # join(join(a0, a2), join(a1, a3))[.., q, c, d] is a_{2c+d}; joining the low halves' with the high halves' adds
    # the last axis e, so flattened, column 8q + 4c + 2d + e takes half e of output 2c + d
    lo = tl.join(tl.join(r0 & 0xFFFF, r2 & 0xFFFF), tl.join(r1 & 0xFFFF, r3 & 0xFFFF))
    hi = tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16))
    u = tl.reshape(tl.join(lo, hi), (BLOCK_M, BLOCK_N)).to(tl.int32)
    return u >= threshold


def keep_threshold(p: float) -> int:
    """T of keep = u ≥ T for the rate p: round(p · 2¹⁶) (u takes each of 0 … 2¹⁶ − 1 with chance 2⁻¹⁶)."""
    return round(p * 65536)


def rate_args(p: float) -> tuple[int, float]:
    """What a kernel drawing ``keep_mask`` takes for the rate p: the keep threshold and the scale 1 / (1 − p)."""
    return keep_threshold(p), 1.0 / (1.0 - p)


def seeded_dropout_reference(t: torch.Tensor, mask: torch.Tensor, p: float, out: torch.Tensor | None = None,
                             accumulate: bool = False) -> torch.Tensor:
    """t · mask / (1 − p) in t's dtype (added into ``out`` with ``accumulate``), for a stored bool mask."""
    dropped = t * mask * (1 / (1 - p))
    if out is None:
        return dropped
    if accumulate:
        return out.add_(dropped)
    return out.copy_(dropped)


@triton.jit
def _seeded_dropout_kernel(T, OUT, SEED, n_rows, n_cols, stride_t, stride_out, threshold, scale, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr):
    """OUT[rows, cols] (+)= T · scale where kept (``keep_mask``), else (+)= 0; the product (and the sum) in fp32,
    rounded once to OUT's dtype."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    keep = keep_mask(tl.load(SEED), rows, col0, n_cols, threshold, BLOCK_M, BLOCK_N)
    t = tl.load(T + rows[:, None] * stride_t + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    y = tl.where(keep, t * scale, 0.0)
    out_at = OUT + rows[:, None] * stride_out + cols[None, :]
    if ACCUMULATE:
        y += tl.load(out_at, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_at, y.to(OUT.dtype.element_ty), mask=inside)


def check_rate(p: float) -> None:
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in (0, 1), got {p!r}")


def seeded_dropout(t: torch.Tensor, seed: torch.Tensor, p: float, out: torch.Tensor | None = None,
                   accumulate: bool = False) -> torch.Tensor:
    """drop(t) for a 2-D ``t`` (unit column stride) with the mask of ``seed`` (int64 [1] on t's device): written
    into ``out`` (same shape and dtype, unit column stride; added to it with ``accumulate``) or a new tensor."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"seeded_dropout takes a 2-D tensor with unit column stride, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    check_rate(p)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs the tensor to add into (out)")
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    elif out.shape != t.shape or out.dtype != t.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(t.shape)} {t.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    rows, cols = t.shape
    if rows and cols:
        launch(_seeded_dropout_kernel, (cdiv(rows, TUNING.block_rows), cdiv(cols, TUNING.block_cols)),
               [t, out, seed, rows, cols, t.stride(0), out.stride(0), *rate_args(p)],
               dict(BLOCK_M=TUNING.block_rows, BLOCK_N=TUNING.block_cols, ACCUMULATE=accumulate,
                    num_warps=TUNING.num_warps))
    return out


class DropoutDraw:
    """One adapter's dropout mask for one forward over ``like`` (2-D): a seed (kernel path) or a bool mask."""

    def __init__(self, like: torch.Tensor, p: float, seed: torch.Tensor | None = None):
        """``seed``: an int64 [1] view on like's device (one of several drawn together), else one is drawn here."""
        self.p = p
        self.shape = tuple(like.shape)
        if _seeded(like):
            self.seed = seed if seed is not None else new_seeds(1, like.device)
            self.stored = None
        else:
            self.seed = None
            self.stored = torch.empty_like(like, dtype=torch.bool).bernoulli_(1 - p)

    def apply(self, t: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """drop(t) with this draw's mask (t of the shape it was drawn for), into ``out`` when given."""
        if tuple(t.shape) != self.shape:
            raise ValueError(f"this dropout mask is {self.shape}, got a tensor of {tuple(t.shape)}")
        if self.stored is not None:
            return seeded_dropout_reference(t, self.stored, self.p, out, accumulate)
        if t.stride(1) != 1:
            t = t.contiguous()
        return seeded_dropout(t, self.seed, self.p, out, accumulate)

    def mask(self) -> torch.Tensor:
        """The bool mask (drawn again from the seed on the kernel path)."""
        if self.stored is not None:
            return self.stored
        ones = torch.ones(self.shape, dtype=torch.float32, device=self.seed.device)
        return seeded_dropout(ones, self.seed, self.p) != 0


class GroupDraws:
    """The dropout draws of a group of adapters over one input: a ``DropoutDraw`` per adapter (None at rate 0),
    indexable and iterable as their list. On the kernel path ``seeds`` holds every adapter's seed (int64 [k], drawn
    in one call; a zero-rate adapter's is never read), each draw's seed a view of it: the form
    kernels/ops/dropout_matmul.py reads."""

    def __init__(self, like: torch.Tensor, rates: list[float]):
        self.rates = [float(p) for p in rates]
        for p in self.rates:
            if p:
                check_rate(p)
        self.seeds = new_seeds(len(self.rates), like.device) if _seeded(like) else None
        self.draws = [None if p == 0 else DropoutDraw(like, p, None if self.seeds is None else self.seeds[i:i + 1])
                      for i, p in enumerate(self.rates)]

    @property
    def seeded(self) -> bool:
        return self.seeds is not None

    def __len__(self) -> int:
        return len(self.draws)

    def __iter__(self):
        return iter(self.draws)

    def __getitem__(self, i: int) -> DropoutDraw | None:
        return self.draws[i]


def draws_for(like: torch.Tensor, rates: list[float]) -> GroupDraws:
    """One draw over ``like`` per rate (None where the rate is 0), the kernel path's seeds drawn together."""
    return GroupDraws(like, rates)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _seeded(like: torch.Tensor) -> bool:
    """Whether a draw over ``like`` keeps a seed for the kernels (else the reference path's stored mask): float64
    takes the reference, as the kernels compute in fp32."""
    return use_triton(like) and like.stride(-1) == 1 and like.dtype in _KERNEL_DTYPES


def new_seeds(n: int, device: torch.device) -> torch.Tensor:
    """n seeds (int64 [n] on ``device``) from torch's generator there."""
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)
