"""AdamW's update of one parameter tensor in a single pass: p, g, m, v read once, p, m, v written once.

Math (torch.optim.AdamW, in the order its fused CUDA kernel uses), fp32 throughout, step count t ≥ 1 read from
a 0-dim fp32 device tensor (already incremented for this step, as torch's fused path keeps it):
    p ← p − lr·wd·p
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε)
then p, m, v are rounded once to their own dtypes. 1 − βᵗ is formed on the device from t·ln β without cancelling
(_one_minus_pow; no host sync for t). 1 − β is formed on the host too: Triton hands float arguments to the
kernel in fp32, and 1 − fp32(0.999) is 1.3e-5 off in relative terms (one rounding of the host's difference: 6e-8).

Why a kernel of its own: torch's fused AdamW (multi_tensor_apply over 64K-element chunks) streamed at 2.3–2.7 TB/s
in the H200 step profiles (BENCHMARKS.md: 17.1 ms of the 196 ms Llama-3-8B-width step for 2.8e9 bf16 parameters,
14 bytes each), against ~4.2 TB/s for a plain copy. One launch per parameter tensor that streams whole 16-byte
vectors per thread moves the same bytes at the copy rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, on_input_device


@dataclass(frozen=True)
class AdamWTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    block: int = 4096  # elements per program: 16 per thread at 8 warps, two 16-byte loads of each bf16 tensor
    num_warps: int = 8


TUNING = AdamWTuning()


def adamw_reference_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, *,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """The update in PyTorch ops, in place on p, m, v (step: 0-dim tensor, already incremented): in fp32, or in
    fp64 for fp64 tensors (the tests' exact reference)."""
    compute = torch.promote_types(p.dtype, torch.float32)
    t = step.to(p.device, compute)
    p_, g_, m_, v_ = (x.to(compute) for x in (p, g, m, v))
    p_ = p_ - lr * weight_decay * p_
    m_ = beta1 * m_ + (1 - beta1) * g_
    v_ = beta2 * v_ + (1 - beta2) * g_ * g_
    step_size = lr / (1 - torch.pow(beta1, t))
    denom = v_.sqrt() / torch.sqrt(1 - torch.pow(beta2, t)) + eps
    p_ = p_ - step_size * m_ / denom
    p.copy_(p_)
    m.copy_(m_)
    v.copy_(v_)


@triton.jit
def _one_minus_pow(t, log_beta):
    """1 − βᵗ from x = t·ln β ≤ 0 without cancellation: 1 − eˣ rounds away the digits that matter when βᵗ is near 1
    (β2 = 0.999 at t = 1: 1 − 0.999 from an fp32 exp would be good to ~1e-4 only). For x > −½ the Taylor series of
    −expm1(x) to x⁸ (truncation < 1e-8 relative); below, eˣ < 0.61 and the subtraction loses nothing."""
    x = t * log_beta
    series = 1.9841269841269841e-4 + x * 2.4801587301587302e-5  # 1/7! + x/8!, then Horner down to 1/1!
    series = 4.1666666666666664e-2 + x * (8.3333333333333332e-3 + x * (1.3888888888888889e-3 + x * series))
    series = -x * (1.0 + x * (0.5 + x * (1.6666666666666666e-1 + x * series)))
    return tl.where(x > -0.5, series, 1.0 - tl.exp(x))


@triton.jit
def _adamw_kernel(P, G, M, V, STEP, LR, n, lr, beta1, beta2, one_minus_beta1, one_minus_beta2, log_beta1, log_beta2,
                  eps, weight_decay, LR_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask).to(tl.float32)
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    m = tl.load(M + offs, mask=mask).to(tl.float32)
    v = tl.load(V + offs, mask=mask).to(tl.float32)
    t = tl.load(STEP)
    if LR_ON_DEVICE:  # a CUDA graph replays the step: the scheduler's current lr is read, not the captured one
        lr = tl.load(LR)
    bias1 = _one_minus_pow(t, log_beta1)
    bias2_sqrt = tl.sqrt(_one_minus_pow(t, log_beta2))
    p = p - lr * weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


@on_input_device  # a cuda:1 parameter must not run on the current cuda:0 (Triton launches there)
def adamw_step_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor, *,
                lr: float | torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of ``p`` in place (with its moments ``m``, ``v``), given its gradient ``g`` and its
    step count ``step`` (0-dim fp32 tensor on p's device, already incremented). All four tensors contiguous, of
    p's shape, on one CUDA device (or on the CPU under TRITON_INTERPRET=1). lr: a float, or a 0-dim fp32 tensor
    on p's device read by the kernel (what a captured step needs). No host sync."""
    for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.shape != p.shape or t.device != p.device:
            raise ValueError(f"{name} {tuple(t.shape)} on {t.device} does not match the parameter "
                             f"{tuple(p.shape)} on {p.device}")
    if not all(t.is_contiguous() for t in (p, g, m, v)):
        raise ValueError("adamw_step_ needs contiguous parameter, gradient and moments")
    if step.numel() != 1 or step.dtype != torch.float32 or step.device != p.device:
        raise ValueError(f"step must be a 0-dim float32 tensor on {p.device}, got {step.dtype} on {step.device}")
    if not 0.0 < beta1 < 1.0 or not 0.0 < beta2 < 1.0:
        raise ValueError(f"betas must be in (0, 1), got ({beta1}, {beta2})")
    on_device = isinstance(lr, torch.Tensor)
    if on_device and (lr.numel() != 1 or lr.dtype != torch.float32 or lr.device != p.device):
        raise ValueError(f"a tensor lr must be a 0-dim float32 tensor on {p.device}, got {lr.dtype} on {lr.device}")
    n = p.numel()
    if n == 0:
        return
    if p.dtype == torch.float64:
        # torch's AdamW (its fused kernel too) updates float64 in float64; this kernel's math (and its float
        # arguments) are fp32, so float64 takes the reference: device ops, no host sync, capturable.
        adamw_reference_(p, g, m, v, step, lr=lr.reshape(()).double() if on_device else lr, beta1=beta1, beta2=beta2,
                         eps=eps, weight_decay=weight_decay)
        return
    launch(_adamw_kernel, (cdiv(n, TUNING.block),),
           [p, g, m, v, step, lr if on_device else step, n, 0.0 if on_device else float(lr), float(beta1),
            float(beta2), 1.0 - beta1, 1.0 - beta2, math.log(beta1), math.log(beta2), float(eps), float(weight_decay)],
           dict(LR_ON_DEVICE=on_device, BLOCK=TUNING.block, num_warps=TUNING.num_warps))
