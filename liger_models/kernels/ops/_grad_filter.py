"""Linear-CE's opt-in gradient filter (``grad_filter_eps``): the backward GEMMs over the vocabulary columns that carry
gradient, skipping the rest.

Rule: within one token chunk, a vocabulary column j is skipped when every row t has |∂ℓ_t/∂z_tj| < eps, where ℓ_t
is token t's own loss (the loss scale, the mean's denominator and grad_output excluded; the softcap derivative,
z-loss and label smoothing included) and z the logits. A skipped column contributes nothing to dh, to its row of
dW and to its bias entry (nor to du and its row of dB, with a low-rank term); a kept column's contributions are
exact, from every row of the chunk. So rows of dW are
either exact or zero for the chunk, and each row of dh misses Σ_skipped ∂ℓ/∂z_tj·W_j, every term below eps·|W_j|.

Why columns and not tiles: cuBLAS runs the GEMMs (at ~700 TFLOP/s; a Triton GEMM that skips tiles, as
cut-cross-entropy's does, runs its dense case at 180-190 TFLOP/s on the H200, 2026-11-30, BENCHMARKS.md), and
cuBLAS can skip work only by being given smaller operands: the kept columns of dlogits and the matching rows of W
are gathered, multiplied, and dW's rows scattered back. On the benchmark's peaked logits 0.4-0.5% of the columns of
a 2048-row chunk carry an entry ≥ 2⁻¹² (cut-cross-entropy's default threshold; its 128×128 tiles keep ~30% of
the work), so the backward GEMMs shrink ~200×. Finding the columns costs one read of the chunk's dlogits
(_active_columns_kernel) and one host sync (the count sizes the GEMMs). When many columns carry gradient the
gathers and the narrower GEMMs cost more than they save: on the H200 the kept-column path overtook the dense GEMMs
between 50% and 60% of the columns at three chunk shapes (0.71-0.87x of dense at 50%, 1.01-1.40x at 60%;
benchmarks/tools/tune_grad_filter.py --dense-share), so above TUNING.dense_share of the columns a chunk takes the dense
path.
This is an approximation, off by default: the rare tokens' rows of dW get nothing from a chunk whose tokens all
give them probability below eps.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, sm_count


@dataclass(frozen=True)
class GradientFilterTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Above this share of active columns a chunk runs the dense GEMMs (just below the measured crossing, 50-60%).
    dense_share: float = 0.5
    # Gathered operands of one slab of columns (dlogits columns, W rows, fp32 dW rows) stay within this many bytes,
    # except that a slab always holds at least min_slab_cols columns (narrower GEMMs run far below the matmul rate).
    slab_bytes: int = 256 << 20
    min_slab_cols: int = 1024
    # The filter pass's tile: 16 rows × 128 columns over 4 warps ran at 2.9-3.1 TB/s on the H200, the best of six tiles
    # at three chunk shapes (benchmarks/tools/tune_grad_filter.py: 32×128 1.8-2.3, 16×512 over 8 warps 2.5-2.6 TB/s).
    block_m: int = 16
    block_v: int = 128
    num_warps: int = 4


TUNING = GradientFilterTuning()


@triton.jit
def _active_columns_kernel(D, SCALE, FLAGS, n_rows, stride_row, scale_stride, eps,
                           N_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    # Program (c, r): columns c·BLOCK_V.., rows r·BLOCK_M, (r + R)·BLOCK_M, ... (R = programs along axis 1).
    # FLAGS[j] becomes 1 if some row has an entry with |d| ≥ eps·|scale_row| and d ≠ 0 (zero rows, e.g. ignored
    # tokens or a zero grad_output, never mark a column). A while loop: the interpreter cannot `for` to a runtime
    # bound. The hits stay a tile until the loop ends: a reduction over rows in every iteration (across warps, through
    # shared memory) held the pass to 1.2-1.3 TB/s on the H200 (now 1.8-2.3 at the same tile, 2.9-3.1 at 16×128).
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < N_COLS
    hit = tl.zeros([BLOCK_M, BLOCK_V], tl.int32)
    start = tl.program_id(1).to(tl.int64) * BLOCK_M
    step = tl.num_programs(1).to(tl.int64) * BLOCK_M
    while start < n_rows:
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < n_rows
        thr = eps * tl.abs(tl.load(SCALE + rows * scale_stride, mask=row_ok, other=0.0).to(tl.float32))
        d = tl.abs(tl.load(D + rows[:, None] * stride_row + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                           other=0.0).to(tl.float32))
        hit = tl.maximum(hit, ((d >= thr[:, None]) & (d != 0.0)).to(tl.int32))
        start += step
    tl.atomic_max(FLAGS + cols, tl.max(hit, axis=0), mask=col_ok)


def active_columns(dlogits: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Sorted int64 indices of the columns of dlogits (M, V; unit column stride) that hold an entry d with
    |d| ≥ eps·|scale_row| and d ≠ 0. scale: 0-dim, or (M,) per row (dlogits = scale_row · ∂ℓ/∂z). Syncs the host."""
    return column_flags(dlogits, scale, eps).nonzero()[:, 0]


def column_flags(dlogits: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """(V,) int32: 1 for the columns active_columns returns, 0 elsewhere (no host sync)."""
    m, v = dlogits.shape
    flags = torch.zeros(v, dtype=torch.int32, device=dlogits.device)
    if m == 0:
        return flags
    col_blocks = cdiv(v, TUNING.block_v)
    # rows split over enough programs to fill the GPU ~4 times (a 32K-column vocabulary has only 256 column blocks)
    row_splits = max(1, min(cdiv(m, TUNING.block_m), cdiv(4 * sm_count(dlogits.device), col_blocks)))
    scale = scale.reshape(-1).float()
    launch(_active_columns_kernel, (col_blocks, row_splits),
           [dlogits, scale, flags, m, dlogits.stride(0), 0 if scale.numel() == 1 else 1, float(eps)],
           dict(N_COLS=v, BLOCK_M=TUNING.block_m, BLOCK_V=TUNING.block_v, num_warps=TUNING.num_warps))
    return flags


def _scatter_add_rows(targets: list[torch.Tensor], cols: torch.Tensor, rows: torch.Tensor) -> None:
    """targets (vocabulary row ranges stacked in order, e.g. the two halves of an accumulator) [cols] += rows."""
    if len(targets) == 1:  # the whole vocabulary: no split to look up (the lookup reads the device)
        targets[0].index_add_(0, cols, rows.to(targets[0].dtype))
        return
    ends = list(itertools.accumulate(t.shape[0] for t in targets))
    # where each target's range starts and ends in the sorted cols, read back in one sync
    cuts = [0] + torch.searchsorted(cols, torch.tensor(ends, device=cols.device)).tolist()
    for target, start, lo, hi in zip(targets, [0] + ends, cuts, cuts[1:]):
        if hi > lo:
            target.index_add_(0, cols[lo:hi] - start, rows[lo:hi].to(target.dtype))


def sparse_gradients(dlogits: torch.Tensor, cols: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
                     grad_h: torch.Tensor | None, dw_targets: list[torch.Tensor] | None,
                     grad_b: torch.Tensor | None, mm_fp32, low_rank: tuple | None = None) -> None:
    """One chunk's gradients from the kept columns only: grad_h (M, H) = dlogits[:, cols]·W[cols] (written),
    dw_targets[cols] += dlogits[:, cols]ᵀ·h (the fp32 product added once per chunk, in the target's dtype),
    grad_b[cols] += column sums (fp32). mm_fp32(out, a, b, first): out (fp32) [+]= aᵀ·b, as linear-CE's dW GEMM.
    low_rank: (u (M, r), B (V, r), grad_u (M, r) or None, grad_B (V, r) fp32 or None), the low-rank term's
    gradients alike: grad_u = dlogits[:, cols]·B[cols] (written), grad_B[cols] += dlogits[:, cols]ᵀ·u.
    Slabs of columns bound the gathered operands (TUNING.slab_bytes); with more than one slab grad_h and grad_u are
    summed in fp32."""
    m, hdim = h.shape
    u, lw, grad_u, grad_lw = low_rank if low_rank is not None else (None, None, None, None)
    if cols.numel() == 0:  # nothing carries gradient: dh and du are 0, dW, db and dB unchanged
        for g in (grad_h, grad_u):
            if g is not None:
                g.zero_()
        return
    rank = 0 if u is None else u.shape[1]
    per_col = (2 * m + (2 * hdim if grad_h is not None else 0) + (4 * hdim if dw_targets is not None else 0)
               + (2 * rank if grad_u is not None else 0) + (4 * rank if grad_lw is not None else 0))
    slab = max(TUNING.min_slab_cols, TUNING.slab_bytes // per_col)
    slabs = [cols[i : i + slab] for i in range(0, cols.numel(), slab)]
    gh32 = gu32 = None
    if len(slabs) > 1:
        if grad_h is not None:
            gh32 = torch.empty(m, hdim, dtype=torch.float32, device=h.device)
        if grad_u is not None:
            gu32 = torch.empty(m, rank, dtype=torch.float32, device=h.device)
    for k, part in enumerate(slabs):
        d = dlogits.index_select(1, part)
        for grad, grad32, w in ((grad_h, gh32, weight), (grad_u, gu32, lw)):  # d·W[cols] and d·B[cols]
            if grad is None:
                continue
            w = w.index_select(0, part)
            if grad32 is None:
                torch.mm(d, w, out=grad)
            else:
                mm_fp32(grad32, d.t(), w, first=k == 0)
        if dw_targets is not None:
            dw = torch.empty(part.numel(), hdim, dtype=torch.float32, device=h.device)
            mm_fp32(dw, d, h, first=True)
            _scatter_add_rows(dw_targets, part, dw)
        if grad_lw is not None:
            dlw = torch.empty(part.numel(), rank, dtype=torch.float32, device=h.device)
            mm_fp32(dlw, d, u, first=True)
            grad_lw.index_add_(0, part, dlw)
        if grad_b is not None:
            grad_b.index_add_(0, part, d.sum(0, dtype=torch.float32))
    for grad, grad32 in ((grad_h, gh32), (grad_u, gu32)):
        if grad32 is not None:
            grad.copy_(grad32)
