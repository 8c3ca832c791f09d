"""x · Wᵀ for a few rows of x and an NF4 weight W (kernels/ops/nf4.py's layout), W decoded inside the K-loop.

Decoding steps multiply 1-16 rows by every weight of the model: memory-bound, so what counts is the bytes read. The
dequantise-then-GEMM path reads 0.5 byte a weight of codes, writes a 2-byte weight, reads it back (and, for packed
q|k|v or gate|up, copies it once more into the stacked weight): 4.5-8.5 bytes a weight against a bf16 model's 2. Here
each program decodes its tile of codes in registers and multiplies at once: 0.5 byte a weight plus the fp32 block
scales (1/16 byte). Each weight is rounded to x's dtype before the product, as the dequantised weight is, so the
result is ``F.linear(x, dequantize_nf4(W))`` up to the order of the fp32 sums.

Training steps have thousands of rows, where the GEMM's own rate dominates and the dequantised weight is read once
per tile of rows: they keep the dequantise-then-GEMM path (``rows_fit`` says which path a call takes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import use_triton
from .._launch import cdiv, launch, pow2, sm_count
from .nf4 import BLOCK, code_table


@dataclass(frozen=True)
class Nf4MatmulTuning:
    """Launch settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # x's rows up to which the decode-in-the-loop kernel runs: at one row it beats dequantising and one GEMM at every
    # Llama-3.1-8B projection (0.017-0.066 ms against 0.017-0.114) and batch-1 decoding runs 2.45x faster (8.17 against
    # 20.05 ms a token); at 4 rows it loses at k|v (0.020 against 0.017 ms), at 16 everywhere (one H100, 2026-12-07:
    # BENCHMARKS.md, "Decoding on an NF4 base").
    max_rows: int = 1
    # Elements of the fp32 product tile (x's rows × W's rows × 32 bytes of a 64-value block) a program holds: W's
    # rows per program are this ÷ (32 × the power of two ≥ x's rows), at least min_block_n. 8192 was no faster.
    tile: int = 4096
    min_block_n: int = 16
    num_warps: int = 4  # 8 was slower at 4-16 rows
    # Programs aimed at per SM: narrow weights (k|v at 1024 rows) split K over several programs to fill the GPU.
    programs_per_sm: int = 4


TUNING = Nf4MatmulTuning()
ROWS = 16  # the most rows nf4_matmul takes (its register tile)
STEP_BYTES = 32  # a 64-value block's codes: one K-step of a row


@triton.jit
def _nf4_matmul_kernel(X, CODES, ABSMAX, TABLE, OUT, BIAS, M, N, K, steps_per_split, stride_xm, stride_xk,
                       stride_os, stride_om, stride_on, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       ALIGNED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """OUT[split, m, n] = Σ over this split's K-steps of x[m, k] · w[n, k] (+ bias on split 0), w decoded from its
    byte (high nibble: the even column) and its 64-value block's fp32 scale, rounded to x's dtype, multiplied and
    summed in fp32, stored in OUT's dtype. A K-step is 32 bytes of a row: when rows are whole blocks (ALIGNED: K a
    multiple of 64) one block, whose scale is loaded once per row; otherwise a row's bytes straddle blocks and each
    byte's scale is looked up. Even and odd columns stay apart (x's even and odd columns are loaded apart)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rj = tl.arange(0, 32)
    row_bytes = K // 2
    in_n = rn < N
    row_at = rn.to(tl.int64) * row_bytes
    step_end = tl.minimum((split + 1) * steps_per_split, tl.cdiv(row_bytes, 32))
    # Products summed elementwise across the loop and reduced over the 32 bytes once at the end.
    acc = tl.zeros((BLOCK_M, BLOCK_N, 32), dtype=tl.float32)
    for step in range(split * steps_per_split, step_end):
        kb = step * 32 + rj
        in_row = kb < row_bytes
        in_w = in_n[:, None] & in_row[None, :]
        byte = tl.load(CODES + row_at[:, None] + kb[None, :], mask=in_w, other=0).to(tl.int32)
        if ALIGNED:
            scale = tl.load(ABSMAX + row_at // 32 + step, mask=in_n, other=0.0)[:, None]
        else:
            scale = tl.load(ABSMAX + (row_at[:, None] + kb[None, :]) // 32, mask=in_w, other=0.0)
        # Two loads from the 16 codes (L1-resident): one 8-byte load of both from a 256-entry table of pairs was
        # slower at every shape (one H100, 2026-12-07).
        high = (tl.load(TABLE + (byte >> 4)) * scale).to(X.dtype.element_ty).to(tl.float32)
        low = (tl.load(TABLE + (byte & 15)) * scale).to(X.dtype.element_ty).to(tl.float32)
        in_x = (rm[:, None] < M) & in_row[None, :]
        x_row = X + rm[:, None] * stride_xm + (2 * kb[None, :]) * stride_xk
        x_even = tl.load(x_row, mask=in_x, other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + stride_xk, mask=in_x, other=0.0).to(tl.float32)
        acc += high[None, :, :] * x_even[:, None, :] + low[None, :, :] * x_odd[:, None, :]
    result = tl.sum(acc, axis=2)
    if HAS_BIAS:
        bias = tl.load(BIAS + rn, mask=in_n, other=0.0).to(tl.float32)
        result += tl.where(split == 0, bias, 0.0)[None, :]
    out = OUT + split.to(tl.int64) * stride_os + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out, result.to(OUT.dtype.element_ty), mask=(rm[:, None] < M) & in_n[None, :])


def rows_limit() -> int:
    """The most rows of x that the model's NF4 projections send to ``nf4_matmul`` (``TUNING.max_rows``)."""
    return min(TUNING.max_rows, ROWS)


def rows_fit(x2: torch.Tensor, codes: torch.Tensor, shape: tuple[int, int], max_rows: int | None = None) -> bool:
    """Whether ``nf4_matmul`` takes this product: at most ``max_rows`` rows (TUNING's when None), a 16- or 32-bit
    float dtype, an even row length (each byte's two codes in one row), on CUDA or under Triton's interpreter,
    outside torch.compile."""
    limit = rows_limit() if max_rows is None else min(max_rows, ROWS)
    return (x2.dim() == 2 and 0 < x2.shape[0] <= limit and shape[1] % 2 == 0 and x2.shape[1] == shape[1]
            and x2.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(x2, codes)
            and not torch.compiler.is_compiling())


def launch_plan(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(x's rows per program, W's rows per program, K-splits, K-steps per split) for x [m, k] · Wᵀ, W [n, k]."""
    t = TUNING
    block_m = pow2(m)
    block_n = max(t.min_block_n, pow2(max(1, t.tile // (STEP_BYTES * block_m))))
    steps = cdiv(k // 2, STEP_BYTES)
    want = (sm_count(device) if device.type == "cuda" else 1) * t.programs_per_sm
    splits = max(1, min(steps, cdiv(want, cdiv(n, block_n))))
    steps_per_split = cdiv(steps, splits)
    return block_m, block_n, cdiv(steps, steps_per_split), steps_per_split  # no empty split


def nf4_matmul(x2: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int],
               bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] · Wᵀ (+ bias, added to the fp32 sums) for the NF4 weight W of ``shape`` [N, K] (codes uint8, fp32
    scales per 64 values), rounded once to x2's dtype, written into ``out`` [M, N] (any strides: a packed output's
    rows) when given. Needs ``rows_fit``."""
    if not rows_fit(x2, codes, shape, max_rows=ROWS):
        raise ValueError(f"nf4_matmul takes 1-{ROWS} rows of an even length equal to the weight's "
                         f"{shape[1]} columns in bf16/fp16/fp32 on CUDA: got x {tuple(x2.shape)} {x2.dtype} on "
                         f"{x2.device}")
    n, k = shape
    if codes.numel() * 2 < n * k or absmax.numel() * BLOCK < n * k:
        raise ValueError(f"NF4 weight of shape {tuple(shape)} needs {n * k // 2} code bytes and {-(-n * k // BLOCK)} "
                         f"block scales, got {codes.numel()} and {absmax.numel()}")
    m = x2.shape[0]
    t = TUNING
    block_m, block_n, splits, steps_per_split = launch_plan(m, n, k, x2.device)
    n_blocks = cdiv(n, block_n)
    if out is None:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    # One split stores the rounded result straight into ``out``; several store fp32 partial sums, added here.
    target = out.unsqueeze(0) if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x2.device)
    bias_or_unused = bias if bias is not None else target  # HAS_BIAS=False never reads it
    launch(_nf4_matmul_kernel, (n_blocks, splits),
           [x2, codes.reshape(-1), absmax.reshape(-1), code_table(codes.device), target, bias_or_unused, m, n, k,
            steps_per_split, x2.stride(0), x2.stride(1), target.stride(0), target.stride(1), target.stride(2)],
           dict(BLOCK_M=block_m, BLOCK_N=block_n, ALIGNED=k % (2 * STEP_BYTES) == 0, HAS_BIAS=bias is not None,
                num_warps=t.num_warps))
    if splits > 1:
        out.copy_(target.sum(0))
    return out
