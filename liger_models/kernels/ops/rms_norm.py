"""RMSNorm, fused residual-add + RMSNorm, and the row-norm kernels that LayerNorm shares.

Math, per row x of length N:  rstd = 1 / sqrt(mean(x²) + eps),  x̂ = x_f32 · rstd
  casting="llama" (HF LlamaRMSNorm; Mistral, Qwen2, Phi3):  y = w · x̂.to(x.dtype)
  casting="gemma" (HF GemmaRMSNorm, offset=1):               y = (x̂ · (offset + w_f32)).to(x.dtype)
The output is in x.dtype (HF promotes w.dtype with x.dtype in llama mode; with both in one dtype it is that dtype,
and bf16·bf16 is exact in fp32, so the fp32 product rounded once is HF's bf16 product bit for bit).
add_rms_norm: r = x + residual (rounded to x.dtype, like HF's `h = h + a`), y = rms_norm(r); returns (y, r).

Backward, with w' = offset + w and g = dy · w':  dx = rstd · (g − x̂ · mean(g · x̂))   (+ dr, the grad of r)
  dW = Σ_rows dy · x̂ (llama: x̂ rounded to x.dtype, as HF multiplies w by the rounded value).
LayerNorm (layer_norm.py) is the CENTER variant of the same kernels: x̂ = (x − mean) · rstd, an extra −mean(g)
term in dx, and dB = Σ_rows dy.

Bytes (bf16, M×N): forward reads x (+ residual) and w, writes y (+ r) and 4 B/row of rstd; backward reads dy, x,
rstd, w (+ dr), writes dx and G×N fp32 dW partials (G = resident programs, a few MB), then one tiny reduction.
Measured on an H200 at 16384×4096 (benchmarks/tools/tune_norms.py): forward 0.069 ms (91% of copy bandwidth), backward
with its reduction 0.111 ms (85%). Launches go through liger_models/kernels/_launch.py: at small sizes host time dominates.

Loops with runtime bounds are written as `while` loops: Triton 3.6's interpreter (CI) cannot use a runtime int as
a `range` bound under NumPy ≥ 2.4 (it calls int() on a 1-element array); on the GPU both compile to the same loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import nn

from .._custom_ops import absent, custom_op, refuse_double_backward
from .._dispatch import interpreting, once_differentiable, row_view, use_triton
from .._launch import cdiv, compiled, launch, on_input_device, pow2, sm_count
from ._norm_backward import MAX_CHUNKS as _WIDE_MAX_CHUNKS
from ._norm_backward import _norm_bwd_wide_kernel, row_stats, sum_partials

_CASTINGS = ("llama", "gemma")


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """PyTorch RMSNorm in HF's numeric order (see the module docstring); output in x.dtype.

    Low-precision inputs are normalised in fp32 like HF; float64 inputs stay float64 (the test reference).
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        w = weight + offset if offset else weight
        return (w * xn.to(x.dtype)).to(x.dtype)
    return (xn * (offset + weight.to(acc))).to(x.dtype)


@triton.jit
def _load_input(X, RES, R_OUT, rows, cols, mask, stride_x_row, stride_res_row, n_cols,
                HAS_RESIDUAL: tl.constexpr, STORE_R: tl.constexpr):
    """A (BLOCK_M, BLOCK_N) fp32 tile of the norm's input: x, or r = x + residual rounded to x's dtype."""
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RES + rows[:, None] * stride_res_row + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(R_OUT.dtype.element_ty)
        if STORE_R:
            tl.store(R_OUT + rows[:, None] * n_cols + cols[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _affine(xhat, W, B, cols, col_mask, offset, GEMMA: tl.constexpr, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """y = x̂ · (offset + w) (+ b) in the casting mode's order, returned in the output dtype."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    if GEMMA:
        y = xhat * w[None, :]
    else:
        y = xhat.to(dtype).to(tl.float32) * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y.to(dtype)


@triton.jit
def _norm_fwd_kernel(
    X, RES, W, B, Y, R_OUT, MEAN, RSTD,
    n_rows, n_cols, stride_x_row, stride_res_row, eps, offset,
    CENTER: tl.constexpr, GEMMA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SPLIT_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # BLOCK_M rows per program: small rows are batched into one 2-D tile so every program moves ~16 KB.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)  # rows × stride can pass 2³¹
    cols = tl.arange(0, BLOCK_N)
    if not SPLIT_N:
        # The whole row stays in registers: one read of x, one write of y.
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_input(X, RES, R_OUT, rows, cols, mask, stride_x_row, stride_res_row, n_cols, HAS_RESIDUAL, True)
        if CENTER:
            mean = tl.sum(x, axis=1) / n_cols
            x = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        y = _affine(x * rstd[:, None], W, B, cols, col_mask, offset, GEMMA, HAS_BIAS, Y.dtype.element_ty)
        tl.store(Y + rows[:, None] * n_cols + cols[None, :], y, mask=mask)
    else:
        # Rows too long for registers: loop over column blocks, re-reading the row (from L2) for each pass.
        # r is recomputed from x + residual in later passes (same rounding), never read back from R_OUT.
        mean = tl.zeros((BLOCK_M,), tl.float32)
        if CENTER:  # a separate mean pass: Σx² − (Σx)²/N cancels badly when |mean| ≫ std
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            start = tl.full((), 0, tl.int32)
            while start < n_cols:
                mask = row_mask[:, None] & (start + cols < n_cols)[None, :]
                acc += _load_input(X, RES, R_OUT, rows, start + cols, mask, stride_x_row, stride_res_row, n_cols,
                                   HAS_RESIDUAL, True)
                start += BLOCK_N
            mean = tl.sum(acc, axis=1) / n_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        start = tl.full((), 0, tl.int32)
        while start < n_cols:
            mask = row_mask[:, None] & (start + cols < n_cols)[None, :]
            x = _load_input(X, RES, R_OUT, rows, start + cols, mask, stride_x_row, stride_res_row, n_cols,
                            HAS_RESIDUAL, not CENTER)
            x = tl.where(mask, x - mean[:, None], 0.0)
            acc += x * x
            start += BLOCK_N
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / n_cols + eps)
        start = tl.full((), 0, tl.int32)
        while start < n_cols:
            col_mask = start + cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_input(X, RES, R_OUT, rows, start + cols, mask, stride_x_row, stride_res_row, n_cols,
                            HAS_RESIDUAL, False)
            xhat = (x - mean[:, None]) * rstd[:, None]
            y = _affine(xhat, W, B, start + cols, col_mask, offset, GEMMA, HAS_BIAS, Y.dtype.element_ty)
            tl.store(Y + rows[:, None] * n_cols + (start + cols)[None, :], y, mask=mask)
            start += BLOCK_N
    if CENTER:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _norm_bwd_row_dots_kernel(
    DY, X, W, MEAN, RSTD, C0, C1, n_cols, stride_dy_row, stride_x_row, offset,
    CENTER: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Split rows only: the per-row means of g and g·x̂ that dx needs, so the column blocks of the main backward
    # kernel can run in separate programs (costs one extra read of dy and x).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rstd, mean = row_stats(RSTD, MEAN, row, CENTER)
    acc0 = tl.zeros((BLOCK_N,), tl.float32)
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    start = tl.full((), 0, tl.int32)
    while start < n_cols:
        col_mask = start + cols < n_cols
        dy = tl.load(DY + row * stride_dy_row + start + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = tl.load(X + row * stride_x_row + start + cols, mask=col_mask, other=0.0).to(tl.float32)
        g = dy * (tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)
        acc0 += g
        acc1 += g * tl.where(col_mask, (x - mean) * rstd, 0.0)
        start += BLOCK_N
    if CENTER:
        tl.store(C0 + row, tl.sum(acc0, axis=0) / n_cols)
    tl.store(C1 + row, tl.sum(acc1, axis=0) / n_cols)


@triton.jit
def _bwd_tile_loads(DY, X, DRES, MEAN, RSTD, C0, C1, block, cols, col_mask, n_rows, stride_dy_row, stride_x_row,
                    stride_dres_row, CENTER: tl.constexpr, HAS_DRES: tl.constexpr, SPLIT_N: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    """Issue the loads of row block ``block``: (dy, x, dres, rstd, mean, c0, c1), tiles in storage dtype.

    Unused values are (BLOCK_M,) zeros so the caller's loop carries the same names in every variant.
    """
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)  # rows × stride can pass 2³¹
    dy = tl.load(DY + rows[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0)
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    zero = tl.zeros((BLOCK_M,), tl.float32)
    mean, c0, c1, dres = zero, zero, zero, zero
    if CENTER:
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    if HAS_DRES:
        dres = tl.load(DRES + rows[:, None] * stride_dres_row + cols[None, :], mask=mask, other=0.0)
    if SPLIT_N:
        c1 = tl.load(C1 + rows, mask=row_mask, other=0.0)
        if CENTER:
            c0 = tl.load(C0 + rows, mask=row_mask, other=0.0)
    return dy, x, dres, rstd, mean, c0, c1


@triton.jit
def _norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DRES, C0, C1, DX, DW_PART, DB_PART,
    n_rows, n_cols, stride_dy_row, stride_x_row, stride_dres_row, offset,
    CENTER: tl.constexpr, GEMMA: tl.constexpr, HAS_DRES: tl.constexpr, COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr, SPLIT_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Persistent grid: axis 0 has about as many programs as fit on the GPU at once; each loops over row blocks
    # and keeps its dW (dB) partial in fp32 registers, written once at the end. G×N partials (not M×N) are then
    # summed in a fixed order by _norm_backward.sum_partials: deterministic, no atomics.
    # Axis 1 splits long rows into column blocks (SPLIT_N); the row dots then come from _norm_bwd_row_dots_kernel.
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    # Accumulating the full tile (not its column sums) keeps the per-iteration update free of cross-warp traffic.
    dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    block = pid
    dy_n, x_n, dres_n, rstd_n, mean_n, c0_n, c1_n = _bwd_tile_loads(
        DY, X, DRES, MEAN, RSTD, C0, C1, block, cols, col_mask, n_rows, stride_dy_row, stride_x_row,
        stride_dres_row, CENTER, HAS_DRES, SPLIT_N, BLOCK_M)
    while block < n_blocks:
        dy, x, dres, rstd, mean, c0, c1 = dy_n.to(tl.float32), x_n.to(tl.float32), dres_n, rstd_n, mean_n, c0_n, c1_n
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        # Software pipelining by hand: the next block's loads are issued before this block's reductions, so each
        # program keeps two tiles in flight and HBM latency hides behind the math (fully masked past the end).
        block += tl.num_programs(0)
        dy_n, x_n, dres_n, rstd_n, mean_n, c0_n, c1_n = _bwd_tile_loads(
            DY, X, DRES, MEAN, RSTD, C0, C1, block, cols, col_mask, n_rows, stride_dy_row, stride_x_row,
            stride_dres_row, CENTER, HAS_DRES, SPLIT_N, BLOCK_M)
        if CENTER:
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        else:
            xhat = x * rstd[:, None]
        # Accumulate dW before the row reductions so that dy is dead across their barriers (fewer live registers).
        if COMPUTE_DW:
            if GEMMA:
                dw += dy * xhat
            else:
                dw += dy * xhat.to(X.dtype.element_ty).to(tl.float32)
        if COMPUTE_DB:
            db += dy
        g = dy * w[None, :]
        if not SPLIT_N:
            c1 = tl.sum(g * xhat, axis=1) / n_cols
            if CENTER:
                c0 = tl.sum(g, axis=1) / n_cols
        dx = (g - xhat * c1[:, None] - c0[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += dres.to(tl.float32)
        tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        tl.store(DW_PART + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PART + pid * n_cols + cols, tl.sum(db, axis=0), mask=col_mask)


@dataclass(frozen=True)
class NormTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Tiling. A row up to _MAX_FUSED_*_N elements is held in registers; longer rows are split into split_block_n
    # column blocks. Compiled for sm_90 (ptxas, bf16, no spills): the forward needs 32–61 registers; the backward,
    # which carries the next tile's raw loads, the fp32 dW tile and w through its loop, ~80 registers at 8 elements
    # per thread and 124–128 at 16, and spills at 32 (a fused 16K row), hence its lower fused limit.
    # Bytes in flight per SM are what hide HBM latency: the forward gets them from many resident programs, the
    # persistent backward from two tiles in flight per program (its hand-pipelined loop) × resident programs.
    max_fused_fwd_n: int = 16384
    max_fused_bwd_n: int = 8192
    split_block_n: int = 4096
    fwd_tile: int = 4096
    fwd_elems_per_thread: int = 16
    bwd_tile: int = 4096
    bwd_elems_per_thread: int = 16
    programs_per_sm: int | None = None  # backward grid override (benchmarks/tools/tune_norms.py); None = occupancy
    # Rows of 8K-16K columns: one backward reading each row twice, the second time from L2 (numbers: _norm_backward.py).
    wide_bwd: bool = True
    wide_chunk: int = 4096
    wide_elems_per_thread: int = 4
    wide_l2_hints_min_chunks: int = 4
    # LayerNorm's wide backward: 8 elements per thread, rows of at most 3 chunks, no L2 hints (99)
    wide_ln_elems_per_thread: int = 8
    wide_ln_max_chunks: int = 3
    wide_ln_l2_hints_min_chunks: int = 99


TUNING = NormTuning()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """row_view(x), returning a 2-D unit-column-stride tensor itself (no dispatcher round trip)."""
    return x if x.dim() == 2 and x.stride(1) == 1 else row_view(x)


def _tiling(n_rows: int, n_cols: int, max_fused: int, tile: int, per_thread: int) -> tuple[bool, int, int, int]:
    """(split, BLOCK_M, BLOCK_N, num_warps) for one row-norm launch."""
    block_n = pow2(n_cols)
    split = block_n > max_fused
    if split:
        block_n = min(TUNING.split_block_n, max_fused)
    block_m = 1 if split else min(max(1, tile // block_n), pow2(n_rows))
    num_warps = min(16, max(1, block_m * block_n // (32 * per_thread)))
    return split, block_m, block_n, num_warps


@on_input_device
def norm_forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float, offset: float, *, center: bool, gemma: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Row-norm forward on 2-D views with unit column stride: (y, r or None, mean or None, rstd), fresh tensors."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    r = torch.empty_like(y) if residual is not None else None
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device) if center else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, r, mean, rstd
    split, block_m, block_n, num_warps = _tiling(n_rows, n_cols, TUNING.max_fused_fwd_n, TUNING.fwd_tile,
                                                 TUNING.fwd_elems_per_thread)
    # Unused pointers are None (constexpr): no argument to check, no driver query.
    args = [x, residual, weight, bias, y, r, mean, rstd, n_rows, n_cols, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps, offset]
    meta = dict(CENTER=center, GEMMA=gemma, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                SPLIT_N=split, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    launch(_norm_fwd_kernel, (cdiv(n_rows, block_m),), args, meta)
    return y, r, mean, rstd


@on_input_device
def norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor,
    dres: torch.Tensor | None, offset: float, *, center: bool, gemma: bool, need_dw: bool, need_db: bool,
    db_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Row-norm backward on 2-D unit-column-stride views: (dx [+ dres], dW or None, dB or None)."""
    n_rows, n_cols = x.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        zeros = torch.zeros_like(weight)
        return dx, zeros if need_dw else None, zeros.to(db_dtype or weight.dtype, copy=True) if need_db else None
    split, block_m, block_n, num_warps = _tiling(n_rows, n_cols, TUNING.max_fused_bwd_n, TUNING.bwd_tile,
                                                 TUNING.bwd_elems_per_thread)
    wide_chunks = TUNING.wide_ln_max_chunks if center else _WIDE_MAX_CHUNKS
    if split and TUNING.wide_bwd and n_cols <= wide_chunks * TUNING.wide_chunk:
        return _wide_backward(dy, x, weight, mean, rstd, dres, dx, offset, center, gemma, need_dw, need_db, db_dtype)
    n_col_blocks = cdiv(n_cols, block_n) if split else 1
    c0 = c1 = None
    if split:
        c1 = torch.empty_like(rstd)
        c0 = torch.empty_like(rstd) if center else None
        launch(_norm_bwd_row_dots_kernel, (n_rows,),
               [dy, x, weight, mean, rstd, c0, c1, n_cols, dy.stride(0), x.stride(0), offset],
               dict(CENTER=center, BLOCK_N=block_n, num_warps=max(4, num_warps)))
    meta = dict(CENTER=center, GEMMA=gemma, HAS_DRES=dres is not None, COMPUTE_DW=need_dw, COMPUTE_DB=need_db,
                SPLIT_N=split, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    args = [dy, x, weight, mean, rstd, dres, c0, c1, dx, rstd if need_dw else None, rstd if need_db else None,
            n_rows, n_cols, dy.stride(0), x.stride(0), dres.stride(0) if dres is not None else 0, offset]
    return _persistent_backward(_norm_bwd_kernel, args, meta, 9, cdiv(n_rows, block_m), n_col_blocks, dx, weight,
                                need_dw, need_db, db_dtype)


def _wide_backward(dy, x, weight, mean, rstd, dres, dx, offset, center, gemma, need_dw, need_db, db_dtype):
    n_rows, n_cols = x.shape
    n_chunks = cdiv(n_cols, TUNING.wide_chunk)
    per_thread, hints_from = ((TUNING.wide_ln_elems_per_thread, TUNING.wide_ln_l2_hints_min_chunks) if center
                              else (TUNING.wide_elems_per_thread, TUNING.wide_l2_hints_min_chunks))
    meta = dict(CENTER=center, GEMMA=gemma, HAS_DRES=dres is not None, COMPUTE_DW=need_dw, COMPUTE_DB=need_db,
                N_CHUNKS=n_chunks, CHUNK=TUNING.wide_chunk, L2_HINTS=n_chunks >= hints_from,
                num_warps=max(1, min(32, TUNING.wide_chunk // (32 * per_thread))))
    args = [dy, x, weight, mean, rstd, dres, dx, rstd if need_dw else None, rstd if need_db else None,
            n_rows, n_cols, dy.stride(0), x.stride(0), dres.stride(0) if dres is not None else 0, offset]
    return _persistent_backward(_norm_bwd_wide_kernel, args, meta, 7, n_rows, 1, dx, weight, need_dw, need_db,
                                db_dtype)


def _persistent_backward(kernel, args: list, meta: dict, dw_arg: int, row_units: int, n_col_blocks: int,
                         dx: torch.Tensor, weight: torch.Tensor, need_dw: bool, need_db: bool,
                         db_dtype: torch.dtype | None = None):
    """Launch a persistent backward (one wave: as many programs as fit at once, so the fewest fp32 dW / dB partial
    rows; the interpreter gets 4), then reduce the partials: (dx, dW or None, dB or None). rstd stands in for the
    partials (args[dw_arg], args[dw_arg + 1]: same dtype and alignment) until the grid, and so their size, is known."""
    device, n_cols = dx.device, dx.shape[1]
    info = None if interpreting() else compiled(kernel, args, meta, device)
    resident = 4 if info is None else info[2]
    if TUNING.programs_per_sm is not None:
        resident = TUNING.programs_per_sm * sm_count(device)
    n_prog = max(1, min(row_units, resident // n_col_blocks))
    for i, needed in ((dw_arg, need_dw), (dw_arg + 1, need_db)):
        if needed:
            args[i] = torch.empty((n_prog, n_cols), dtype=torch.float32, device=device)
    launch(kernel, (n_prog, n_col_blocks), args, meta, info)
    dw = sum_partials(args[dw_arg], weight.dtype) if need_dw else None
    # dB in the bias's own dtype (db_dtype, default the weight's): an fp32 bias beside a bf16 weight keeps fp32 sums
    return dx, dw, sum_partials(args[dw_arg + 1], db_dtype or weight.dtype) if need_db else None


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, gemma):
        x2 = _rows(x)
        res2 = None if residual is None else _rows(residual)
        y, r, _, rstd = norm_forward(x2, res2, weight, None, eps, offset, center=False, gemma=gemma)
        ctx.save_for_backward(x2 if r is None else r, weight, rstd)  # the norm's input and rstd, nothing else
        ctx.offset, ctx.gemma = offset, gemma
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.set_materialize_grads(False)  # an unused r (the last layer's) costs no zero-filled gradient read
        if x.dim() != 2:
            y, r = y.view(x.shape), None if r is None else r.view(x.shape)
        return y if residual is None else (y, r)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dres=None):
        xs, weight, rstd = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[2]
        if dy is None:  # only r was used downstream: the norm contributes nothing
            dr, dw = dres, torch.zeros_like(weight) if need_dw else None
        else:
            dx, dw, _ = norm_backward(
                _rows(dy), xs, weight, None, rstd, None if dres is None else _rows(dres), ctx.offset,
                center=False, gemma=ctx.gemma, need_dw=need_dw, need_db=False,
            )
            dr = dx if dy.dim() == 2 else dx.view(dy.shape)
        if ctx.residual_dtype is None:
            return dr, None, dw, None, None, None
        # x and residual both receive dL/dr (norm backward + the grad of the returned r).
        return dr, dr.to(ctx.residual_dtype) if ctx.needs_input_grad[1] else None, dw, None, None, None


@custom_op("rms_norm")
def _rms_norm_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, offset: float,
                 gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_RMSNormFunction's forward as a custom op (_custom_ops.py): (y, r or a placeholder, rstd); y and r in x's
    shape."""
    res2 = None if residual is None else _rows(residual)
    y, r, _, rstd = norm_forward(_rows(x), res2, weight, None, eps, offset, center=False, gemma=gemma)
    return y.view(x.shape), absent(x) if r is None else r.view(x.shape), rstd


@_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, gemma):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r = absent(x) if residual is None else torch.empty_like(y)
    return y, r, x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@custom_op("rms_norm_backward")
def _rms_norm_backward_op(dy: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                          dres: Optional[torch.Tensor], offset: float, gemma: bool,
                          need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """_RMSNormFunction's backward for a given dy: (dx [+ dres] in dy's shape, dW or a placeholder)."""
    dx, dw, _ = norm_backward(_rows(dy), _rows(xs), weight, None, rstd, None if dres is None else _rows(dres), offset,
                              center=False, gemma=gemma, need_dw=need_dw, need_db=False)
    return dx.view(dy.shape), absent(weight) if dw is None else dw


@_rms_norm_backward_op.register_fake
def _(dy, xs, weight, rstd, dres, offset, gemma, need_dw):
    dx = torch.empty(dy.shape, dtype=xs.dtype, device=xs.device)
    return dx, torch.empty_like(weight) if need_dw else absent(weight)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, residual, weight, _, offset, gemma = inputs
    _, r, rstd = output
    ctx.save_for_backward(x if residual is None else r, weight, rstd)
    ctx.offset, ctx.gemma = offset, gemma
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)  # as the Function: an unused r costs no zero-filled gradient


def _rms_norm_backward(ctx, dy, dres, _drstd):
    refuse_double_backward("rms_norm")
    xs, weight, rstd = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[2]
    if ctx.residual_dtype is None:
        dres = None  # the gradient of r's placeholder
    if dy is None:  # only r was used downstream: the norm contributes nothing
        dr, dw = dres, torch.zeros_like(weight) if need_dw else None
    else:
        dr, dw = _rms_norm_backward_op(dy, xs, weight, rstd, dres, ctx.offset, ctx.gemma, need_dw)
        dw = dw if need_dw else None
    if ctx.residual_dtype is None:
        return dr, None, dw, None, None, None
    return dr, dr.to(ctx.residual_dtype) if ctx.needs_input_grad[1] else None, dw, None, None, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def _check(x: torch.Tensor, weight: torch.Tensor, casting: str) -> None:
    if casting not in _CASTINGS:
        raise ValueError(f"casting must be one of {_CASTINGS}, got {casting!r}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"rms_norm needs a floating-point input, got {x.dtype}")
    if not isinstance(weight, torch.Tensor):  # the kernels always scale by it (no weight-free RMSNorm here)
        raise TypeError(f"rms_norm needs a weight tensor, got {type(weight).__name__}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm needs a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def unit_stride(p: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D weight / bias the kernels can index with a unit stride (they take no stride for it): a strided view
    is copied, through autograd so its gradient still reaches the view; a Parameter is returned as is."""
    return p if p is None or p.is_contiguous() else p.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape and strides); autograd-aware; output in x.dtype."""
    _check(x, weight, casting)
    if not use_triton(x, weight):
        return rms_norm_reference(x, weight, eps, offset, casting)
    if torch.compiler.is_compiling():  # the custom op, which dynamo traces (_custom_ops.py)
        return _rms_norm_op(x, None, unit_stride(weight), float(eps), float(offset), casting == "gemma")[0]
    return _RMSNormFunction.apply(x, None, unit_stride(weight), float(eps), float(offset), casting == "gemma")


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual; return rms_norm(r), r`` in one pass; gradients reach both x and residual."""
    _check(x, weight, casting)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if not use_triton(x, residual, weight):
        r = x + residual.to(x.dtype)
        return rms_norm_reference(r, weight, eps, offset, casting), r
    if torch.compiler.is_compiling():
        return _rms_norm_op(x, residual, unit_stride(weight), float(eps), float(offset), casting == "gemma")[:2]
    return _RMSNormFunction.apply(x, residual, unit_stride(weight), float(eps), float(offset), casting == "gemma")


class RMSNorm(nn.Module):
    """RMSNorm with HF parameter name ``weight``, initialised to 1 − offset (ones for llama, zeros for gemma's
    offset form) so that a fresh module scales x̂ by offset + w = 1 in any casting / offset pairing."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting: str = "llama",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if casting not in _CASTINGS:
            raise ValueError(f"casting must be one of {_CASTINGS}, got {casting!r}")
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device, dtype=dtype))
        self.eps, self.offset, self.casting = eps, offset, casting

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``, or ``add_rms_norm(x, residual)`` → (y, x + residual) when a residual is given."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, offset=self.offset, casting=self.casting)
        return add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}"
