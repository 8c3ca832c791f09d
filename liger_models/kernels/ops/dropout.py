"""Dropout whose mask is drawn again instead of stored: LoRA's dropout on an adapter's input.

Math: drop(t) = t · keep / (1 − p), keep = u ≥ p with u uniform in [0, 1). PEFT applies ``nn.Dropout`` to the input
of every adapter, independently per adapter, and the adapter's backward needs the same mask twice more: for dA
(drop(x) itself) and for dX (the mask times the gradient). Stored, the mask is one byte per input element per adapter
(q, k and v each draw their own: 6·H + I bytes a token a layer at Llama widths, more than the layer's checkpoint).
Here u is a function of a seed and the element's index, u = Philox(seed, row · cols + col) (Triton's ``tl.rand``),
so forward and backward each draw it where they need it and what is kept between them is the seed: one int64 on the
device, drawn from torch's generator on that device (so ``torch.manual_seed`` fixes it, activation checkpointing's
restored RNG state draws it again, and a CUDA-graph capture replays a fresh one every step).

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

    # Not swept yet: an elementwise pass of one read and one write (two with accumulate) per element, whose
    # step-level cost is measured in BENCHMARKS.md ("LoRA / QLoRA training step", dropout).
    block: int = 2048  # columns per program
    num_warps: int = 4


TUNING = DropoutTuning()


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
def _seeded_dropout_kernel(T, OUT, SEED, n_cols, stride_t, stride_out, p, scale, BLOCK: tl.constexpr,
                           ACCUMULATE: tl.constexpr):
    """OUT[row, cols] (+)= T[row, cols] · scale where Philox(seed, row · n_cols + col) ≥ p, else (+)= 0; the product
    (and the sum) in fp32, rounded once to OUT's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    keep = tl.rand(tl.load(SEED), row * n_cols + cols) >= p
    t = tl.load(T + row * stride_t + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.where(keep, t * scale, 0.0)
    if ACCUMULATE:
        y += tl.load(OUT + row * stride_out + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, y.to(OUT.dtype.element_ty), mask=inside)


def seeded_dropout(t: torch.Tensor, seed: torch.Tensor, p: float, out: torch.Tensor | None = None,
                   accumulate: bool = False) -> torch.Tensor:
    """drop(t) for a 2-D ``t`` (unit column stride) with the mask of ``seed`` (int64 [1] on t's device): written
    into ``out`` (same shape and dtype, unit column stride; added to it with ``accumulate``) or a new tensor."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"seeded_dropout takes a 2-D tensor with unit column stride, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in (0, 1), got {p!r}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs the tensor to add into (out)")
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    elif out.shape != t.shape or out.dtype != t.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(t.shape)} {t.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    rows, cols = t.shape
    if rows and cols:
        launch(_seeded_dropout_kernel, (rows, cdiv(cols, TUNING.block)),
               [t, out, seed, cols, t.stride(0), out.stride(0), float(p), 1.0 / (1.0 - p)],
               dict(BLOCK=TUNING.block, ACCUMULATE=accumulate, num_warps=TUNING.num_warps))
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


def draws_for(like: torch.Tensor, rates: list[float]) -> list[DropoutDraw | None]:
    """One draw over ``like`` per rate (None where the rate is 0), the kernel path's seeds drawn together."""
    seeds = iter(new_seeds(sum(p > 0 for p in rates), like.device)) if _seeded(like) else None
    return [None if p == 0 else DropoutDraw(like, p, None if seeds is None else next(seeds)[None]) for p in rates]


def _seeded(like: torch.Tensor) -> bool:
    """Whether a draw over ``like`` keeps a seed for the kernel (else the reference path's stored mask)."""
    return use_triton(like) and like.stride(-1) == 1


def new_seeds(n: int, device: torch.device) -> torch.Tensor:
    """n seeds (int64 [n] on ``device``) from torch's generator there."""
    return torch.randint(0, 2**62, (n,), dtype=torch.int64, device=device)
