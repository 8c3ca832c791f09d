"""Sum of gathered rows: out[t] = Σ_j w[t, j] · rows[pos[t, j]] over a token's k slots (the MoE combine).

A mixture-of-experts layer (modules/moe.py) computes its experts' outputs in rows sorted by expert; each token's
output is the weighted sum of its k rows, and in backward each token's input gradient is the plain sum of its k
rows' gradients. In PyTorch each is three passes: the gather back to (token, slot) order (the S rows written), the
product with the weights (written again: in fp32 with Mixtral's fp32 weights), the sum over k; here it is one pass
that reads the S rows once and writes the N token rows.

HF numerics (transformers' grouped_mm experts, ``(out[inverse] * w).sum(dim=1)``), kept exactly: each product is
rounded to the product's dtype (torch's promotion of the rows' and the weights' dtypes: bf16 with Qwen3-MoE's bf16
weights, fp32 with Mixtral's fp32 ones), the k products are summed in fp32 and the sum rounded once to that dtype,
then cast to the output dtype. Without weights the rows are summed in fp32 and rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import use_triton
from .._launch import cdiv, launch, on_input_device, pow2


@dataclass(frozen=True)
class SlotSumTuning:
    """Launch settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # columns per program (a power of two); a token's row of D columns is cdiv(D, block) programs
    block: int = 1024
    # the kernel; False: the three PyTorch passes (gather, scale, sum), kept as the bisection path. The kernel reads
    # each expert row once and writes each token once: 9% off the MoE layer's forward + backward at Qwen3-30B-A3B
    # width and 2% at Mixtral's, 256 / 128 MiB off its peak (bench_moe, 2026-12-06, H100: BENCHMARKS.md
    # "Mixture-of-experts layer")
    fused: bool = True


TUNING = SlotSumTuning()


def slot_sum_reference(rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch form: rows (S, D), positions (N, k) int64 into rows, weights (N, k) or None → (N, D)."""
    gathered = rows[positions.reshape(-1)].view(*positions.shape, rows.shape[1])
    if weights is not None:
        gathered = gathered * weights[..., None]
    return gathered.sum(dim=1).to(out_dtype or gathered.dtype)


@triton.jit
def _slot_sum_kernel(
    ROWS, POS, W, OUT, n_cols, top_k, stride_rows, stride_out,
    HAS_W: tl.constexpr, ROUND_PRODUCT: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(top_k):
        pos = tl.load(POS + token * top_k + j)
        r = tl.load(ROWS + pos * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            r = r * tl.load(W + token * top_k + j).to(tl.float32)
            if ROUND_PRODUCT:  # the product in the rows' (bf16 / fp16) dtype, as torch's would be
                r = r.to(ROWS.dtype.element_ty).to(tl.float32)
        acc += r
    tl.store(OUT + token * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@on_input_device
def slot_sum(rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[t] = Σ_j weights[t, j] · rows[positions[t, j]] (weights None: 1), rows (S, D) with unit column stride,
    positions (N, k) int64, weights (N, k); in the product's dtype (module docstring), cast to ``out_dtype``. No
    autograd: the MoE layer's autograd Function calls it in its forward and backward."""
    n_tokens, top_k = positions.shape
    product = rows.dtype if weights is None else torch.promote_types(rows.dtype, weights.dtype)
    out_dtype = out_dtype or product
    if not (use_triton(rows, positions, weights) and TUNING.fused) or rows.stride(-1) != 1:
        return slot_sum_reference(rows, positions, weights, out_dtype)
    # The sum is rounded once, to the product's dtype, then cast: for an output dtype finer than it, round first.
    finer = torch.finfo(out_dtype).bits > torch.finfo(product).bits
    target = torch.empty(n_tokens, rows.shape[1], dtype=product if finer else out_dtype, device=rows.device)
    if target.numel() == 0 or top_k == 0:
        return target.zero_().to(out_dtype)
    block = min(TUNING.block, pow2(rows.shape[1]))
    positions = positions.contiguous()
    launch(_slot_sum_kernel, (n_tokens, cdiv(rows.shape[1], block)),
           [rows, positions, positions if weights is None else weights.contiguous(), target, rows.shape[1], top_k,
            rows.stride(0), target.stride(0)],
           dict(HAS_W=weights is not None, ROUND_PRODUCT=weights is not None and product == rows.dtype
                and rows.dtype != torch.float32, BLOCK=block, num_warps=max(1, min(8, block // 256))))
    return target.to(out_dtype)
