"""The row-norm backward for rows a little too long for registers (kernels/rms_norm.py's ``_wide_backward``).

Between _MAX_FUSED_BWD_N and 4 chunks of _WIDE_CHUNK columns (8K-16K at the defaults), a whole fp32 row of dy and
x beside the fp32 dW tile does not fit in one program's registers (a fused 16K-column row spills: 1024 threads ×
64 registers is all an SM holds). The split path reads dy and x from HBM twice (a row-dots kernel, then column
blocks). This kernel walks whole rows and reads each one twice too, but back to back on one SM, so the second read
is served by L2. Same math and dW partial layout as ``_norm_bwd_kernel``.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
        rstd = tl.load(RSTD + r)
        mean = 0.0
        if CENTER:
            mean = tl.load(MEAN + r)
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
