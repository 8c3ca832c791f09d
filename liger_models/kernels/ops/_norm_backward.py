"""Two pieces of the row-norm backward (liger_models/kernels/ops/rms_norm.py): the kernel for rows a little too long for registers
(``_wide_backward``), and the deterministic reduction of the persistent backwards' fp32 dW / dB partials.

Between _MAX_FUSED_BWD_N and 4 chunks of _WIDE_CHUNK columns (8K-16K at the defaults), a whole fp32 row of dy and
x beside the fp32 dW tile does not fit in one program's registers (a fused 16K-column row spills: 1024 threads ×
64 registers is all an SM holds). The split path reads dy and x from HBM twice (a row-dots kernel, then column
blocks). This kernel walks whole rows and reads each one twice too, but back to back on one SM, so the second read
is served by L2. Same math and dW partial layout as ``_norm_bwd_kernel``.

Knobs (rms_norm.py) and what set them, H200, bf16 backward GPU time (benchmarks/tools/tune_norms.py --sections
wide, two runs): RMSNorm 16384×16384 split 0.660 ms, this kernel 0.455 with L2 hints (pass 1 loads evict_last, pass 2
evict_first) at 4 elements per thread (32 warps: twice the loads in flight per SM of 8), 0.554-0.587 without the
hints or at 8; 4096×16384 0.180 → 0.130 (same variant); 8192×12288 (3 chunks) 0.262 → 0.189 without the hints at 4
or 8 elements per thread, 0.265 with them — hence hints from _WIDE_L2_HINTS_MIN_CHUNKS = 4 chunks. LayerNorm also
carries dB tiles: best at 8 elements per thread without hints, 8192×12288 0.286 → 0.225 ms, but at 16K columns no
faster than the split path (0.705 vs 0.701 ms), hence _WIDE_LN_MAX_CHUNKS = 3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, pow2, sm_count

MAX_CHUNKS = 4  # register tiles of dW (and dB) that _norm_bwd_wide_kernel carries: rows of at most 4 chunks


@triton.jit
def _add_to_chunk(c: tl.constexpr, v, a0, a1, a2, a3):
    """a_c += v for a compile-time chunk index c (a register tile cannot be indexed at run time)."""
    if c == 0:
        a0 += v
    elif c == 1:
        a1 += v
    elif c == 2:
        a2 += v
    else:
        a3 += v
    return a0, a1, a2, a3


@triton.jit
def _chunk_of(c: tl.constexpr, a0, a1, a2, a3):
    if c == 0:
        return a0
    elif c == 1:
        return a1
    elif c == 2:
        return a2
    return a3


@triton.jit
def row_stats(RSTD, MEAN, row, CENTER: tl.constexpr):
    """(rstd, mean) of one row as the forward saved them (mean 0 without CENTER)."""
    mean = 0.0
    if CENTER:
        mean = tl.load(MEAN + row)
    return tl.load(RSTD + row), mean


@triton.jit
def _wide_row_chunk(DY, X, W, row, start, cols, n_cols, stride_dy_row, stride_x_row, mean, rstd, offset,
                    CENTER: tl.constexpr, POLICY: tl.constexpr):
    """fp32 (dy, x̂, g = dy · w', column mask) of one CHUNK of a row."""
    col_mask = start + cols < n_cols
    dy = tl.load(DY + row * stride_dy_row + start + cols, mask=col_mask, other=0.0, eviction_policy=POLICY)
    x = tl.load(X + row * stride_x_row + start + cols, mask=col_mask, other=0.0, eviction_policy=POLICY)
    dy = dy.to(tl.float32)
    xhat = (x.to(tl.float32) - mean) * rstd
    if CENTER:
        xhat = tl.where(col_mask, xhat, 0.0)
    g = dy * (tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)
    return dy, xhat, g, col_mask


@triton.jit
def _norm_bwd_wide_kernel(
    DY, X, W, MEAN, RSTD, DRES, DX, DW_PART, DB_PART,
    n_rows, n_cols, stride_dy_row, stride_x_row, stride_dres_row, offset,
    CENTER: tl.constexpr, GEMMA: tl.constexpr, HAS_DRES: tl.constexpr, COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr, N_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, L2_HINTS: tl.constexpr,
):
    # Rows of up to 4 CHUNKs, one row at a time per program over a persistent grid. The whole row does not fit in
    # registers beside the dW tile (a fused 16K-column row spills), so each row is read twice: pass 1 for the row
    # dots, pass 2 for dx and dW. Pass 2 follows pass 1 within microseconds on the same SM, so its re-read of the
    # row (64 KB at 16K bf16 columns; ~10 MB for all resident programs) comes from L2, not HBM: one HBM read of
    # dy and x, where the split path's two kernels read them twice. dW stays in registers as N_CHUNKS tiles.
    FIRST: tl.constexpr = "evict_last" if L2_HINTS else ""
    SECOND: tl.constexpr = "evict_first" if L2_HINTS else ""
    pid = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    dw0 = tl.zeros((CHUNK,), tl.float32)
    dw1, dw2, dw3, db0, db1, db2, db3 = dw0, dw0, dw0, dw0, dw0, dw0, dw0
    row = pid
    while row < n_rows:
        r = row.to(tl.int64)  # row × stride can pass 2³¹
        rstd, mean = row_stats(RSTD, MEAN, r, CENTER)
        s0 = tl.zeros((CHUNK,), tl.float32)
        s1 = tl.zeros((CHUNK,), tl.float32)
        for c in tl.static_range(N_CHUNKS):
            _, xhat, g, _ = _wide_row_chunk(DY, X, W, r, c * CHUNK, cols, n_cols, stride_dy_row, stride_x_row,
                                            mean, rstd, offset, CENTER, FIRST)
            s1 += g * xhat
            if CENTER:
                s0 += g
        c1 = tl.sum(s1, axis=0) / n_cols
        c0 = 0.0
        if CENTER:
            c0 = tl.sum(s0, axis=0) / n_cols
        for c in tl.static_range(N_CHUNKS):
            dy, xhat, g, col_mask = _wide_row_chunk(DY, X, W, r, c * CHUNK, cols, n_cols, stride_dy_row,
                                                    stride_x_row, mean, rstd, offset, CENTER, SECOND)
            if COMPUTE_DW:
                if GEMMA:
                    dw0, dw1, dw2, dw3 = _add_to_chunk(c, dy * xhat, dw0, dw1, dw2, dw3)
                else:
                    dw0, dw1, dw2, dw3 = _add_to_chunk(c, dy * xhat.to(X.dtype.element_ty).to(tl.float32),
                                                       dw0, dw1, dw2, dw3)
            if COMPUTE_DB:
                db0, db1, db2, db3 = _add_to_chunk(c, dy, db0, db1, db2, db3)
            dx = (g - xhat * c1 - c0) * rstd
            if HAS_DRES:
                dx += tl.load(DRES + r * stride_dres_row + c * CHUNK + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(DX + r * n_cols + c * CHUNK + cols, dx.to(DX.dtype.element_ty), mask=col_mask)
        row += tl.num_programs(0)
    for c in tl.static_range(N_CHUNKS):
        col_mask = c * CHUNK + cols < n_cols
        if COMPUTE_DW:
            tl.store(DW_PART + pid * n_cols + c * CHUNK + cols, _chunk_of(c, dw0, dw1, dw2, dw3), mask=col_mask)
        if COMPUTE_DB:
            tl.store(DB_PART + pid * n_cols + c * CHUNK + cols, _chunk_of(c, db0, db1, db2, db3), mask=col_mask)


@triton.jit
def _sum_partials_kernel(PART, OUT, n_part, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # Second stage of the dW reduction: a fixed summation order, so the same inputs give the same bits.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    start = tl.full((), 0, tl.int32)
    while start < n_part:
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < n_part)[:, None] & (cols < n_cols)[None, :]
        acc += tl.load(PART + p[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        start += BLOCK_P
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < n_cols)


def sum_partials(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of the (programs, N) fp32 partials, cast to the weight's dtype."""
    n_part, n_cols = part.shape
    out = torch.empty(n_cols, dtype=dtype, device=part.device)
    # About one column block per SM (≥ 32 columns: 128-byte row segments), 4096-element tiles.
    block_n = min(4096, max(32, pow2(cdiv(n_cols, sm_count(part.device)))))
    launch(_sum_partials_kernel, (cdiv(n_cols, block_n),), [part, out, n_part, n_cols],
           dict(BLOCK_P=max(1, 4096 // block_n), BLOCK_N=block_n, num_warps=4))
    return out
