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

    # x's rows up to which the decode-in-the-loop kernel runs; 0, off, until it is measured faster than dequantising
    # and one GEMM: this version took 0.068-0.120 ms against their 0.034-0.035 at 1-16 rows of a 4096² weight (one
    # H100, 2026-12-07: BENCHMARKS.md, "Decoding on an NF4 base"), bound by its gathered loads, not by memory.
    max_rows: int = 0
    block_n: int = 32  # W's rows per program
    # Bytes of codes a row per loop step (two weights each), for one row of x; divided by the power of two ≥ x's rows,
    # down to 16, so that the (rows × block_n × bytes) product tile stays in registers.
    block_bytes: int = 128
    num_warps: int = 4
    # Programs aimed at per SM: narrow weights (k|v at 1024 rows) split K over several programs to fill the GPU.
    programs_per_sm: int = 4


TUNING = Nf4MatmulTuning()
ROWS = 16  # the most rows nf4_matmul takes (its register tile)


@triton.jit
def _nf4_matmul_kernel(X, CODES, ABSMAX, TABLE, PARTIAL, M, N, K, bytes_per_split, stride_xm, stride_xk,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """PARTIAL[split, m, n] = Σ over this split's columns k of x[m, k] · w[n, k], w decoded from its byte (high nibble:
    the even column) and its 64-value block's fp32 scale, rounded to x's dtype, multiplied and summed in fp32. The
    even and odd columns stay apart (x's even and odd columns are loaded apart): no interleave, no tensor-core tile
    of mostly padding rows."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rb = tl.arange(0, BLOCK_B)
    row_bytes = rn.to(tl.int64) * (K // 2)
    b_start = split * bytes_per_split
    b_end = tl.minimum(b_start + bytes_per_split, K // 2)
    # Products summed elementwise across the loop and reduced over the bytes once at the end: no cross-thread
    # reduction per step.
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_B), dtype=tl.float32)
    for b0 in range(b_start, b_end, BLOCK_B):
        kb = b0 + rb
        in_row = kb < b_end
        at = row_bytes[:, None] + kb[None, :]
        in_w = (rn[:, None] < N) & in_row[None, :]
        byte = tl.load(CODES + at, mask=in_w, other=0).to(tl.int32)
        scale = tl.load(ABSMAX + at // 32, mask=in_w, other=0.0)  # 32 bytes (64 values) per block
        high = (tl.load(TABLE + (byte >> 4)) * scale).to(X.dtype.element_ty).to(tl.float32)
        low = (tl.load(TABLE + (byte & 15)) * scale).to(X.dtype.element_ty).to(tl.float32)
        in_x = (rm[:, None] < M) & in_row[None, :]
        x_row = X + rm[:, None] * stride_xm + (2 * kb[None, :]) * stride_xk
        x_even = tl.load(x_row, mask=in_x, other=0.0).to(tl.float32)
        x_odd = tl.load(x_row + stride_xk, mask=in_x, other=0.0).to(tl.float32)
        acc += high[None, :, :] * x_even[:, None, :] + low[None, :, :] * x_odd[:, None, :]
    out = PARTIAL + split.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, tl.sum(acc, axis=2), mask=(rm[:, None] < M) & (rn[None, :] < N))


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
    block_m = pow2(m)
    block_b = max(16, t.block_bytes // block_m)
    n_blocks = cdiv(n, t.block_n)
    b_steps = cdiv(k // 2, block_b)
    want = (sm_count(x2.device) if x2.is_cuda else 1) * t.programs_per_sm
    splits = max(1, min(b_steps, cdiv(want, n_blocks)))
    bytes_per_split = cdiv(b_steps, splits) * block_b
    splits = cdiv(k // 2, bytes_per_split)  # no empty split
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x2.device)
    launch(_nf4_matmul_kernel, (n_blocks, splits),
           [x2, codes.reshape(-1), absmax.reshape(-1), code_table(codes.device), partial, m, n, k, bytes_per_split,
            x2.stride(0), x2.stride(1)],
           dict(BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_B=block_b, num_warps=t.num_warps))
    result = partial[0] if splits == 1 else partial.sum(0)
    if bias is not None:
        result = result + bias.to(torch.float32)
    if out is None:
        return result.to(x2.dtype)
    out.copy_(result)
    return out
