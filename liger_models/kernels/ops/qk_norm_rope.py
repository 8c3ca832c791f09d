"""Per-head RMSNorm of q and k fused with RoPE, read straight from the packed projection output (Qwen3, Gemma 3).

Math, per token and per q (or k) head x (head_dim D, rotary over all of it, h = D/2):
  x̂ = x · rsqrt(mean(x²) + eps)                                 fp32
  y = (w + offset) · x̂.to(dtype)      casting "llama" (Qwen3)    rounded to the activation dtype
  y = (x̂ · (offset + w)).to(dtype)    casting "gemma" (Gemma 3: offset 1, the (1 + w) norm)
  out = y·cos + rotate_half(y)·sin                               fp32, rounded once
which is the RMSNorm kernel's output fed to the RoPE kernel (the norm's output is rounded to the activation dtype in
between, as there): the same values in bf16 (the tests check it bit for bit); in fp32 the sum of squares may round
differently (it is summed in two halves here). v is not normed and not rotated. Under torch.compile the same
kernels run as custom ops (``_custom_ops.py``), so a compiled model computes what the eager one does.

Backward, per head: dy = the inverse rotation of d out (sin → −sin, halves swapped), then the RMSNorm backward
d x̂ = dy · (offset + w), d x = rstd · (d x̂ − x̂ · mean(d x̂ · x̂)), and d w = Σ over tokens and heads of dy · x̂ (x̂
rounded to the activation dtype first in "llama" casting): one program per token writes its heads' share to a
(tokens, D) fp32 buffer that a torch sum reduces.

Layout: one program per token reads that token's Hq + Hkv heads once (cos/sin once for all heads), normalises,
rotates and writes the q and k heads to fresh (B, T, H, D) tensors; v stays a view of the packed input. What the
backward keeps is the packed input (the projection output, which nothing else saves) and cos/sin. Against the
unfused path (two norm launches, a concatenation into a fresh packed tensor, the in-place rope) this reads and
writes q and k once instead of three times and saves no second copy of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._custom_ops import custom_op, refuse_double_backward
from .._dispatch import once_differentiable, use_triton
from .._launch import launch, on_input_device, pow2
from .rms_norm import rms_norm_reference
from .rope import _rotate_reference, _split_heads

CASTINGS = ("llama", "gemma")


def qk_norm_rope_reference(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int, eps: float,
                           offset: float = 0.0, casting: str = "llama"):
    """(q, k, v) (B, T, H, D) in PyTorch: the RMSNorm reference per head, then the RoPE reference (float64 inputs
    stay float64: the tests' truth)."""
    q, k, v = _split_heads(qkv, n_q_heads, n_kv_heads, head_dim)
    q = rms_norm_reference(q, q_weight, eps, offset, casting)
    k = rms_norm_reference(k, k_weight, eps, offset, casting)
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin), v


@triton.jit
def _norm_rope_heads(X, Y, W, cos1, cos2, sin1, sin2, eps, offset, N_HEADS: tl.constexpr, D: tl.constexpr,
                     HALF: tl.constexpr, GEMMA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """Normalise and rotate N_HEADS consecutive heads at X (heads D apart) into Y (heads D apart)."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_R)
    mask = (heads < N_HEADS)[:, None] & (cols < HALF)[None, :]
    offs = heads[:, None] * D + cols[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
    w1 = tl.load(W + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :] + offset
    w2 = tl.load(W + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :] + offset
    dtype = Y.dtype.element_ty
    if GEMMA:
        y1 = (x1 * rstd * w1).to(dtype).to(tl.float32)
        y2 = (x2 * rstd * w2).to(dtype).to(tl.float32)
    else:
        y1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        y2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(Y + offs, (y1 * cos1 - y2 * sin1).to(dtype), mask=mask)
    tl.store(Y + offs + HALF, (y2 * cos2 + y1 * sin2).to(dtype), mask=mask)


@triton.jit
def _token_cos_sin(COS, SIN, start, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token's cos / sin halves as (1, BLOCK_R) rows, zero past HALF."""
    cols = tl.arange(0, BLOCK_R)
    cmask = cols < HALF
    cos1 = tl.load(COS + start + cols, mask=cmask, other=0.0)[None, :]
    cos2 = tl.load(COS + start + cols + HALF, mask=cmask, other=0.0)[None, :]
    sin1 = tl.load(SIN + start + cols, mask=cmask, other=0.0)[None, :]
    sin2 = tl.load(SIN + start + cols + HALF, mask=cmask, other=0.0)[None, :]
    return cos1, cos2, sin1, sin2


@triton.jit
def _qk_norm_rope_fwd_kernel(QKV, Q_OUT, K_OUT, QW, KW, COS, SIN, seq_len, stride_b, stride_t, stride_cos_b,
                             stride_cos_t, eps, offset, N_Q: tl.constexpr, N_K: tl.constexpr, D: tl.constexpr,
                             HALF: tl.constexpr, GEMMA: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // seq_len, pid % seq_len
    cos1, cos2, sin1, sin2 = _token_cos_sin(COS, SIN, b * stride_cos_b + t * stride_cos_t, HALF, BLOCK_R)
    src = QKV + b * stride_b + t * stride_t
    _norm_rope_heads(src, Q_OUT + pid * N_Q * D, QW, cos1, cos2, sin1, sin2, eps, offset, N_Q, D, HALF, GEMMA,
                     BLOCK_HQ, BLOCK_R)
    _norm_rope_heads(src + N_Q * D, K_OUT + pid * N_K * D, KW, cos1, cos2, sin1, sin2, eps, offset, N_K, D, HALF,
                     GEMMA, BLOCK_HK, BLOCK_R)


@triton.jit
def _norm_rope_heads_bwd(DY, stride_dy_h, X, DX, W, DW, cos1, cos2, sin1, sin2, eps, offset,
                         N_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, GEMMA: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """d x of N_HEADS heads (into DX, heads D apart) and this token's share of d w (into DW) from their output
    gradient DY (heads stride_dy_h apart)."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_R)
    cmask = cols < HALF
    mask = (heads < N_HEADS)[:, None] & cmask[None, :]
    d_offs = heads[:, None] * stride_dy_h + cols[None, :]
    d1 = tl.load(DY + d_offs, mask=mask, other=0.0).to(tl.float32)
    d2 = tl.load(DY + d_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dy1 = d1 * cos1 + d2 * sin2  # the rotation's transpose
    dy2 = d2 * cos2 - d1 * sin1
    offs = heads[:, None] * D + cols[None, :]
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
    n1, n2 = x1 * rstd, x2 * rstd
    w1 = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :] + offset
    w2 = tl.load(W + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :] + offset
    dn1, dn2 = dy1 * w1, dy2 * w2
    mean = ((tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1)) / D)[:, None]
    dtype = DX.dtype.element_ty
    tl.store(DX + offs, (rstd * (dn1 - n1 * mean)).to(dtype), mask=mask)
    tl.store(DX + offs + HALF, (rstd * (dn2 - n2 * mean)).to(dtype), mask=mask)
    if not GEMMA:  # "llama": the weight multiplied the normalised value rounded to the activation dtype
        n1, n2 = n1.to(dtype).to(tl.float32), n2.to(dtype).to(tl.float32)
    tl.store(DW + cols, tl.sum(dy1 * n1, axis=0), mask=cmask)
    tl.store(DW + HALF + cols, tl.sum(dy2 * n2, axis=0), mask=cmask)


@triton.jit
def _qk_norm_rope_bwd_kernel(DQ, DK, QKV, DQKV, QW, KW, DQW, DKW, COS, SIN, seq_len, stride_b, stride_t,
                             stride_dq_b, stride_dq_t, stride_dq_h, stride_dk_b, stride_dk_t, stride_dk_h,
                             stride_cos_b, stride_cos_t, eps, offset, N_Q: tl.constexpr, N_K: tl.constexpr,
                             D: tl.constexpr, HALF: tl.constexpr, GEMMA: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b, t = pid // seq_len, pid % seq_len
    cos1, cos2, sin1, sin2 = _token_cos_sin(COS, SIN, b * stride_cos_b + t * stride_cos_t, HALF, BLOCK_R)
    src = QKV + b * stride_b + t * stride_t
    dst = DQKV + pid * (N_Q + 2 * N_K) * D
    _norm_rope_heads_bwd(DQ + b * stride_dq_b + t * stride_dq_t, stride_dq_h, src, dst, QW, DQW + pid * D,
                         cos1, cos2, sin1, sin2, eps, offset, N_Q, D, HALF, GEMMA, BLOCK_HQ, BLOCK_R)
    _norm_rope_heads_bwd(DK + b * stride_dk_b + t * stride_dk_t, stride_dk_h, src + N_Q * D, dst + N_Q * D, KW,
                         DKW + pid * D, cos1, cos2, sin1, sin2, eps, offset, N_K, D, HALF, GEMMA, BLOCK_HK, BLOCK_R)


def _meta(n_q_heads: int, n_kv_heads: int, head_dim: int, gemma: bool) -> dict:
    block_r = pow2(head_dim // 2)
    elems = (pow2(n_q_heads) + pow2(n_kv_heads)) * block_r * 2
    return dict(N_Q=n_q_heads, N_K=n_kv_heads, D=head_dim, HALF=head_dim // 2, GEMMA=gemma,
                BLOCK_HQ=pow2(n_q_heads), BLOCK_HK=pow2(n_kv_heads), BLOCK_R=block_r,
                num_warps=min(16, max(1, pow2(elems // (32 * 32)))))


def _cos_strides(cos: torch.Tensor) -> tuple[int, int]:
    return (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)  # a batch of one broadcasts


@on_input_device
def _forward(qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma):
    bsz, seq_len, _ = qkv.shape
    q_out = qkv.new_empty(bsz, seq_len, n_q_heads, head_dim)
    k_out = qkv.new_empty(bsz, seq_len, n_kv_heads, head_dim)
    if bsz * seq_len:
        launch(_qk_norm_rope_fwd_kernel, (bsz * seq_len,),
               [qkv, q_out, k_out, q_weight, k_weight, cos, sin, seq_len, qkv.stride(0), qkv.stride(1),
                *_cos_strides(cos), eps, offset],
               _meta(n_q_heads, n_kv_heads, head_dim, gemma))
    return q_out, k_out


@on_input_device
def _backward(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma):
    bsz, seq_len, width = qkv.shape
    dqkv = qkv.new_empty(bsz, seq_len, width)
    dq = torch.zeros_like(dqkv[..., : n_q_heads * head_dim]).unflatten(-1, (n_q_heads, head_dim)) if dq is None \
        else (dq if dq.stride(-1) == 1 else dq.contiguous())
    dk = torch.zeros_like(dqkv[..., : n_kv_heads * head_dim]).unflatten(-1, (n_kv_heads, head_dim)) if dk is None \
        else (dk if dk.stride(-1) == 1 else dk.contiguous())
    tokens = bsz * seq_len
    dqw = torch.empty(tokens, head_dim, dtype=torch.float32, device=qkv.device)
    dkw = torch.empty(tokens, head_dim, dtype=torch.float32, device=qkv.device)
    if tokens:
        launch(_qk_norm_rope_bwd_kernel, (tokens,),
               [dq, dk, qkv, dqkv, q_weight, k_weight, dqw, dkw, cos, sin, seq_len, qkv.stride(0), qkv.stride(1),
                dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
                *_cos_strides(cos), eps, offset],
               _meta(n_q_heads, n_kv_heads, head_dim, gemma))
    v_start = (n_q_heads + n_kv_heads) * head_dim
    if dv is None:
        dqkv[..., v_start:].zero_()
    else:
        dqkv[..., v_start:].copy_(dv.reshape(bsz, seq_len, -1))
    return dqkv, dqw.sum(0).to(q_weight.dtype), dkw.sum(0).to(k_weight.dtype)


class _QKNormRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma):
        q, k = _forward(qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma)
        ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin)
        ctx.args = (n_q_heads, n_kv_heads, head_dim, eps, offset, gemma)
        ctx.set_materialize_grads(False)
        v = qkv[..., (n_q_heads + n_kv_heads) * head_dim:].view(*qkv.shape[:-1], n_kv_heads, head_dim)
        return q, k, v

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        qkv, q_weight, k_weight, cos, sin = ctx.saved_tensors
        dqkv, dqw, dkw = _backward(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, *ctx.args)
        return dqkv, dqw, dkw, None, None, None, None, None, None, None, None


@custom_op("qk_norm_rope")
def _qk_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int, eps: float, offset: float,
                     gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The normed, rotated q and k and a copy of v (an op's outputs may not be views of its input)."""
    q, k = _forward(qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma)
    v = qkv[..., (n_q_heads + n_kv_heads) * head_dim:].unflatten(-1, (n_kv_heads, head_dim))
    return q, k, v.clone(memory_format=torch.contiguous_format)


@_qk_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma):
    b, t, _ = qkv.shape
    return tuple(qkv.new_empty(b, t, h, head_dim) for h in (n_q_heads, n_kv_heads, n_kv_heads))


@custom_op("qk_norm_rope_backward")
def _qk_norm_rope_backward_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor,
                              q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              n_q_heads: int, n_kv_heads: int, head_dim: int, eps: float, offset: float,
                              gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset,
                     gemma)


@_qk_norm_rope_backward_op.register_fake
def _(dq, dk, dv, qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps, offset, gemma):
    return torch.empty_like(qkv), torch.empty_like(q_weight), torch.empty_like(k_weight)


def _qk_norm_rope_setup(ctx, inputs, output) -> None:
    qkv, q_weight, k_weight, cos, sin, *ctx.args = inputs
    ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin)


def _qk_norm_rope_grads(ctx, dq, dk, dv):
    refuse_double_backward("qk_norm_rope")
    dqkv, dqw, dkw = _qk_norm_rope_backward_op(dq, dk, dv, *ctx.saved_tensors, *ctx.args)
    return dqkv, dqw, dkw, None, None, None, None, None, None, None, None


_qk_norm_rope_op.register_autograd(_qk_norm_rope_grads, setup_context=_qk_norm_rope_setup)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int, eps: float, offset: float = 0.0,
                 casting: str = "llama") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) (B, T, H, D) from a packed projection output qkv (B, T, (Hq + 2 Hkv)·D): q and k normalised per
    head with their (D,) weights and rotated by cos/sin ((B or 1, T, D) float32, HF layout, the whole head rotated),
    as fresh tensors; v a view of qkv. Differentiable in qkv and both weights (module docstring)."""
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    if qkv.dim() != 3 or qkv.shape[-1] != width or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be (B, T, {width}) with a unit last stride for {n_q_heads} q and {n_kv_heads} "
                         f"kv heads of {head_dim}, got {tuple(qkv.shape)}")
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(f"q/k norm weights must be ({head_dim},), got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}")
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 3 or cos.shape[-1] != head_dim \
            or cos.shape[1] != qkv.shape[1] or cos.shape[0] not in (1, qkv.shape[0]):
        raise ValueError(f"cos/sin must be (B or 1, T, head_dim={head_dim}) for qkv {tuple(qkv.shape)} (the whole "
                         f"head rotated), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
    if not use_triton(qkv, q_weight, k_weight, cos, sin):
        return qk_norm_rope_reference(qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, eps,
                                      offset, casting)
    if torch.compiler.is_compiling():
        return _qk_norm_rope_op(qkv, q_weight, k_weight, cos.contiguous(), sin.contiguous(), n_q_heads, n_kv_heads,
                                head_dim, float(eps), float(offset), casting == "gemma")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return _QKNormRoPE.apply(qkv, q_weight, k_weight, cos, sin, n_q_heads, n_kv_heads, head_dim, float(eps),
                             float(offset), casting == "gemma")
