"""Rotary position embedding (HF rotate_half / NeoX layout) on q and k together.

Math, per head and per token, with R the rotary dim (R ≤ D, even), h = R/2, x1 = x[:h], x2 = x[h:R]:
  y[:h]  = x1·cos[:h] − x2·sin[:h]
  y[h:R] = x2·cos[h:] + x1·sin[h:]
  y[R:]  = x[R:]                              (partial rotary passes the tail through)
i.e. y = x·cos + rotate_half(x)·sin with rotate_half(x) = cat(−x2, x1). HF's cos/sin are cat(freqs, freqs), so
the backward is the inverse rotation (sin → −sin):  dx1 = dy1·cos[:h] + dy2·sin[h:],  dx2 = dy2·cos[h:] − dy1·sin[:h].

HF numerics: HF casts cos/sin (computed in fp32) to the activation dtype and rotates in that dtype, rounding
each product. Here cos/sin stay fp32 and the math is fp32 with one rounding, which is closer to the float64
reference.

Layout and autograd: one launch rotates q and k in place on the (B, T, H, D) projection views (any strides
but a unit one along D), one program per token: cos/sin are loaded once and applied to all q and k heads of
that token. Only the first R dims are touched. `ctx.mark_dirty` cannot be used here: autograd refuses a
Function that modifies a view in place and returns two tensors, and on a single view it would route the
backward through CopySlices (three extra copies of the gradient). So the Function returns aliases of q and k
and leaves the graph as it is. That is exact because rotation is linear (the backward needs only cos/sin) and
the projection's own backward does not read its output (Linear/addmm save their inputs, norms theirs). The
version counter is deliberately not bumped: doing so would re-derive the grad_fn of every sibling view (v of
a fused qkv) as AsStrided, or break split() outputs. Contract: nothing else may save q/k's memory for backward.
The backward writes fresh contiguous gradients and reads dq/dk with any strides (SDPA returns transposed ones).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import use_triton
from ._rounding import cast_rtne

# Per-token tile: at most _HEAD_TILE elements per half-rotation (all heads of a token for usual head counts)
# and _ELEMS_PER_THREAD per thread (→ num_warps); benchmarks/tune_streaming.py sweeps them.
_HEAD_TILE = 4096
_ELEMS_PER_THREAD = 16


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place rotation of q (B, T, Hq, D) and k (B, T, Hkv, D) with cos/sin (B or 1, T, R), fp32 math."""
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r, h = cos.shape[-1], cos.shape[-1] // 2
    compute = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    xr = x[..., :r].to(compute)
    c, s = cos.to(compute).unsqueeze(2), sin.to(compute).unsqueeze(2)  # (B or 1, T, 1, R)
    rotated = xr * c + torch.cat((-xr[..., h:], xr[..., :h]), dim=-1) * s
    return torch.cat((rotated.to(x.dtype), x[..., r:]), dim=-1)


@triton.jit
def _rotate_heads(
    SRC, DST, src_base, dst_base, stride_src_h, stride_dst_h, N_HEADS: tl.constexpr,
    cos1, cos2, sin1, sin2,
    HALF: tl.constexpr, TAIL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    """Rotate the first 2·HALF dims of every head of one token; copy the TAIL dims after them when TAIL > 0."""
    cols = tl.arange(0, BLOCK_R)
    col_mask = cols < HALF
    for h0 in tl.static_range(0, N_HEADS, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < N_HEADS) & col_mask[None, :]
        src = SRC + src_base + heads.to(tl.int64)[:, None] * stride_src_h + cols[None, :]
        dst = DST + dst_base + heads.to(tl.int64)[:, None] * stride_dst_h + cols[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, cast_rtne(x1 * cos1 - x2 * sin1, DST.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, cast_rtne(x2 * cos2 + x1 * sin2, DST.dtype.element_ty), mask=mask)
        if TAIL > 0:
            tail = tl.arange(0, BLOCK_TAIL)
            tail_mask = (heads[:, None] < N_HEADS) & (tail[None, :] < TAIL)
            src_tail = SRC + src_base + heads.to(tl.int64)[:, None] * stride_src_h + 2 * HALF + tail[None, :]
            dst_tail = DST + dst_base + heads.to(tl.int64)[:, None] * stride_dst_h + 2 * HALF + tail[None, :]
            tl.store(dst_tail, tl.load(src_tail, mask=tail_mask), mask=tail_mask)


@triton.jit
def _rope_kernel(
    Q, K, DST_Q, DST_K, COS, SIN, seq_len,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h,
    stride_dq_b, stride_dq_t, stride_dq_h, stride_dk_b, stride_dk_t, stride_dk_h,
    stride_cos_b, stride_cos_t, stride_sin_b, stride_sin_t,
    N_Q_HEADS: tl.constexpr, N_K_HEADS: tl.constexpr, HALF: tl.constexpr, TAIL: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b, t = token // seq_len, token % seq_len
    cols = tl.arange(0, BLOCK_R)
    col_mask = cols < HALF
    cos_row = COS + b * stride_cos_b + t * stride_cos_t
    sin_row = SIN + b * stride_sin_b + t * stride_sin_t
    cos1 = tl.load(cos_row + cols, mask=col_mask, other=0.0)[None, :]
    cos2 = tl.load(cos_row + HALF + cols, mask=col_mask, other=0.0)[None, :]
    sin1 = tl.load(sin_row + cols, mask=col_mask, other=0.0)[None, :]
    sin2 = tl.load(sin_row + HALF + cols, mask=col_mask, other=0.0)[None, :]
    if BACKWARD:
        # The adjoint: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1 (the inverse rotation for HF cos/sin).
        sin1, sin2 = -sin2, -sin1
    _rotate_heads(Q, DST_Q, b * stride_q_b + t * stride_q_t, b * stride_dq_b + t * stride_dq_t, stride_q_h, stride_dq_h,
                  N_Q_HEADS, cos1, cos2, sin1, sin2, HALF, TAIL, BLOCK_HQ, BLOCK_R, BLOCK_TAIL)
    _rotate_heads(K, DST_K, b * stride_k_b + t * stride_k_t, b * stride_dk_b + t * stride_dk_t, stride_k_h, stride_dk_h,
                  N_K_HEADS, cos1, cos2, sin1, sin2, HALF, TAIL, BLOCK_HK, BLOCK_R, BLOCK_TAIL)


def _launch(q, k, cos, sin, dst_q, dst_k, backward: bool) -> None:
    """Rotate q, k (B, T, H, D) into dst_q, dst_k (the same tensors for the in-place forward)."""
    bsz, seq_len, n_q_heads, head_dim = q.shape
    rot = cos.shape[-1]
    # The backward writes fresh tensors, so it also copies the pass-through tail; in place it is left alone.
    tail = head_dim - rot if backward else 0
    if bsz * seq_len == 0:
        return
    if not use_triton(q, k, cos, sin):
        for src, dst in ((q, dst_q), (k, dst_k)):
            if backward:
                h = rot // 2
                dst.copy_(_rotate_reference(src, cos, -torch.cat((sin[..., h:], sin[..., :h]), dim=-1)))
            else:
                dst[..., :rot].copy_(_rotate_reference(src[..., :rot], cos, sin))
        return
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_r = triton.next_power_of_2(rot // 2)
    max_heads = max(1, _HEAD_TILE // block_r)
    block_hq, block_hk = (min(triton.next_power_of_2(h), max_heads) for h in (n_q_heads, k.shape[2]))
    _rope_kernel[(bsz * seq_len,)](
        q, k, dst_q, dst_k, cos, sin, seq_len,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        dst_q.stride(0), dst_q.stride(1), dst_q.stride(2), dst_k.stride(0), dst_k.stride(1), dst_k.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),  # a batch of one broadcasts
        sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1),
        N_Q_HEADS=n_q_heads, N_K_HEADS=k.shape[2], HALF=rot // 2, TAIL=tail, BACKWARD=backward,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_R=block_r, BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
        num_warps=max(1, min(16, block_hq * block_r // (32 * _ELEMS_PER_THREAD))),
    )


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        _launch(q, k, cos, sin, q, k, backward=False)
        ctx.save_for_backward(cos, sin)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_out = torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
        dk_out = torch.empty(dk.shape, dtype=dk.dtype, device=dk.device)
        # dq/dk may be expanded (stride 0) or transposed; the kernel needs only a unit stride along D.
        dq = dq if dq.stride(-1) == 1 else dq.contiguous()
        dk = dk if dk.stride(-1) == 1 else dk.contiguous()
        _launch(dq, dk, cos, sin, dq_out, dk_out, backward=True)
        return dq_out, dk_out, None, None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, T, H, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    (b, t, _, d), (bk, tk, _, dk) = q.shape, k.shape
    if (b, t, d) != (bk, tk, dk):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, T and head_dim")
    if q.dtype != k.dtype or not q.dtype.is_floating_point:
        raise TypeError(f"q and k must share one floating dtype, got {q.dtype} and {k.dtype}")
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(f"cos and sin must both be (B or 1, T, R), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos and sin must be float32 (RoPE angles stay fp32), got {cos.dtype} and {sin.dtype}")
    bc, tc, r = cos.shape
    if bc not in (1, b) or tc != t:
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match q's batch {b} and length {t}")
    if r % 2 or r == 0 or r > d:
        raise ValueError(f"rotary dim {r} must be even, positive and <= head_dim {d}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a unit stride along head_dim (views of the projection output)")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("q, k, cos and sin must be on one device")
    if q.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError("q and k alias the same memory; rope rotates them in place")
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("rope gives no gradient to cos/sin; compute them without grad (they come from inv_freq)")
    for name, x in (("q", q), ("k", k)):
        base = x._base if x._base is not None else x
        if base.requires_grad and base.grad_fn is None and torch.is_grad_enabled():
            raise ValueError(f"rope works in place and {name} is (a view of) a leaf that requires grad; "
                             "pass the projection output (or a clone)")


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate, in place, the first R dims of every head of q (B, T, Hq, D) and k (B, T, Hkv, D); returns (q, k).

    cos/sin: (B or 1, T, R) float32 in HF layout (cat(freqs, freqs), attention scaling already applied), so
    explicit position ids (packed sequences) are expressed by the caller's cos/sin rows. The returned tensors
    alias q and k, which hold the rotated values afterwards; q and k may be slices, views or split() outputs
    of one fused qkv projection, but no other op may have saved their memory for its backward.
    """
    _check(q, k, cos, sin)
    if q.numel() == 0 and k.numel() == 0:
        return q, k
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RoPEFunction.apply(q, k, cos, sin)
    _launch(q, k, cos, sin, q, k, backward=False)
    return q, k
