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
but a unit one along D). A program takes a few consecutive tokens of one sequence with all their q and k heads:
cos/sin are loaded once for all heads, and every q/k load is issued before the first store, so a program
waits for memory once. Only the first R dims are touched. `ctx.mark_dirty` cannot be used here: autograd refuses a
Function that modifies a view in place and returns two tensors, and on a single view it would route the
backward through CopySlices (three extra copies of the gradient). So the Function returns aliases of q and k
and leaves the graph as it is. That is exact because rotation is linear (the backward needs only cos/sin) and
the projection's own backward does not read its output (Linear/addmm save their inputs, norms theirs). The
version counter is deliberately not bumped: doing so would re-derive the grad_fn of every sibling view (v of
a fused qkv) as AsStrided, or break split() outputs. Contract: nothing else may save q/k's memory for backward.
The backward writes fresh contiguous gradients and reads dq/dk with any strides (SDPA returns transposed ones).
Under torch.compile the rotation runs as a functional custom op (_custom_ops.py): the same kernel writes rotated
copies (TO_DST), so no input is modified behind autograd's back; ``rope`` copies them back into q and k.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .._custom_ops import custom_op, refuse_double_backward
from .._dispatch import once_differentiable, use_triton
from .._launch import launch, on_input_device, pow2


@dataclass(frozen=True)
class RopeTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Tiling: tokens_per_program tokens × all heads per program (heads in tiles of at most head_tile elements per
    # half-rotation), elems_per_thread elements per thread (→ num_warps); benchmarks/tools/tune_streaming.py sweeps
    # them.
    # H200, B4 T4096 Hq32 Hkv8 D128 bf16: 1 token × 4 warps runs the forward in 0.091 ms and the backward in 0.093
    # ms (0.87 of the copy bandwidth each); 2 or 4 tokens per program, or 2 or 8 warps, were 2-25% slower.
    tokens_per_program: int = 1
    head_tile: int = 4096
    elems_per_thread: int = 40


TUNING = RopeTuning()


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
def _head_offsets(tok, h0, stride_h, N_HEADS: tl.constexpr, WIDTH: tl.constexpr, t_mask,
                  BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """Offsets (BLOCK_T, BLOCK_H, BLOCK_W) of the first WIDTH dims of heads h0.. of each token (tok: the tokens'
    int64 offsets), and their mask."""
    heads = h0 + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_W)
    mask = t_mask[:, None, None] & (heads < N_HEADS)[None, :, None] & (cols < WIDTH)[None, None, :]
    return tok[:, None, None] + heads.to(tl.int64)[None, :, None] * stride_h + cols[None, None, :], mask


@triton.jit
def _store_rotated(OUT, offs, x1, x2, mask, cos1, cos2, sin1, sin2, HALF: tl.constexpr):
    dtype = OUT.dtype.element_ty
    tl.store(OUT + offs, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
    tl.store(OUT + offs + HALF, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


@triton.jit
def _copy_tail(SRC, DST, src_tok, dst_tok, h0, stride_h, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               ROT: tl.constexpr, TAIL: tl.constexpr, t_mask, BLOCK_H: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """Copy the TAIL pass-through dims after the ROT rotated ones into the gradient (dst_tok: the tokens' offsets
    in DST, whose heads are packed back to back)."""
    src, mask = _head_offsets(src_tok + ROT, h0, stride_h, N_HEADS, TAIL, t_mask, BLOCK_H, BLOCK_TAIL)
    dst, _ = _head_offsets(dst_tok + ROT, h0, HEAD_DIM, N_HEADS, TAIL, t_mask, BLOCK_H, BLOCK_TAIL)
    tl.store(DST + dst, tl.load(SRC + src, mask=mask), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, DST_Q, DST_K, COS, SIN, seq_len,
    stride_q_b, stride_q_t, stride_q_h, stride_k_b, stride_k_t, stride_k_h, stride_cos_b, stride_cos_t,
    stride_dq_t, stride_dk_t,
    N_Q_HEADS: tl.constexpr, N_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    TAIL: tl.constexpr, BACKWARD: tl.constexpr, TO_DST: tl.constexpr, BLOCK_T: tl.constexpr,
    N_TILES: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """BLOCK_T tokens of one sequence, all q and k heads: the rotation (forward) or its transpose (BACKWARD), in
    place (DST_Q/DST_K unused), or with TO_DST (the backward; the forward under torch.compile, whose ops are
    functional) written to DST_Q/DST_K with the pass-through tail (TAIL dims); their tokens lie stride_d*_t apart
    (b·T + t order) and their heads back to back: contiguous (B, T, H, D), or the q/k slices of a packed qkv grad. The loads
    of a tile's q and k heads are all issued before its stores: one memory round trip, not two."""
    pid = tl.program_id(0)
    t_blocks = tl.cdiv(seq_len, BLOCK_T)
    b = (pid // t_blocks).to(tl.int64)
    t = (pid % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < seq_len
    t = t.to(tl.int64)
    # cos/sin rows (sin shares cos's strides) as (BLOCK_T, 1, BLOCK_R), broadcast over heads.
    cols = tl.arange(0, BLOCK_R)
    cs_mask = t_mask[:, None] & (cols < HALF)[None, :]
    cs = b * stride_cos_b + t[:, None] * stride_cos_t + cols[None, :]
    cos1 = tl.load(COS + cs, mask=cs_mask, other=0.0)[:, None, :]
    cos2 = tl.load(COS + cs + HALF, mask=cs_mask, other=0.0)[:, None, :]
    sin1 = tl.load(SIN + cs, mask=cs_mask, other=0.0)[:, None, :]
    sin2 = tl.load(SIN + cs + HALF, mask=cs_mask, other=0.0)[:, None, :]
    if BACKWARD:
        # The adjoint: dx1 = dy1·cos1 + dy2·sin2, dx2 = dy2·cos2 − dy1·sin1 (the inverse rotation for HF cos/sin).
        sin1, sin2 = -sin2, -sin1
    q_tok = b * stride_q_b + t * stride_q_t
    k_tok = b * stride_k_b + t * stride_k_t
    dst_row = b * seq_len + t  # TO_DST: the token's index in DST_Q / DST_K
    dq_tok = dst_row * stride_dq_t
    dk_tok = dst_row * stride_dk_t
    for i in tl.static_range(N_TILES):
        if i * BLOCK_HQ < N_Q_HEADS:
            q_src, q_mask = _head_offsets(q_tok, i * BLOCK_HQ, stride_q_h, N_Q_HEADS, HALF, t_mask, BLOCK_HQ, BLOCK_R)
            q1 = tl.load(Q + q_src, mask=q_mask, other=0.0).to(tl.float32)
            q2 = tl.load(Q + q_src + HALF, mask=q_mask, other=0.0).to(tl.float32)
        if i * BLOCK_HK < N_K_HEADS:
            k_src, k_mask = _head_offsets(k_tok, i * BLOCK_HK, stride_k_h, N_K_HEADS, HALF, t_mask, BLOCK_HK, BLOCK_R)
            k1 = tl.load(K + k_src, mask=k_mask, other=0.0).to(tl.float32)
            k2 = tl.load(K + k_src + HALF, mask=k_mask, other=0.0).to(tl.float32)
        if i * BLOCK_HQ < N_Q_HEADS:
            if TO_DST:
                q_dst, _ = _head_offsets(dq_tok, i * BLOCK_HQ, HEAD_DIM, N_Q_HEADS, HALF,
                                         t_mask, BLOCK_HQ, BLOCK_R)
                _store_rotated(DST_Q, q_dst, q1, q2, q_mask, cos1, cos2, sin1, sin2, HALF)
            else:
                _store_rotated(Q, q_src, q1, q2, q_mask, cos1, cos2, sin1, sin2, HALF)
        if i * BLOCK_HK < N_K_HEADS:
            if TO_DST:
                k_dst, _ = _head_offsets(dk_tok, i * BLOCK_HK, HEAD_DIM, N_K_HEADS, HALF,
                                         t_mask, BLOCK_HK, BLOCK_R)
                _store_rotated(DST_K, k_dst, k1, k2, k_mask, cos1, cos2, sin1, sin2, HALF)
            else:
                _store_rotated(K, k_src, k1, k2, k_mask, cos1, cos2, sin1, sin2, HALF)
        if TAIL > 0:  # TO_DST only: fresh outputs also need the dims the rotation passes through
            if i * BLOCK_HQ < N_Q_HEADS:
                _copy_tail(Q, DST_Q, q_tok, dq_tok, i * BLOCK_HQ, stride_q_h, N_Q_HEADS, HEAD_DIM, 2 * HALF, TAIL,
                           t_mask, BLOCK_HQ, BLOCK_TAIL)
            if i * BLOCK_HK < N_K_HEADS:
                _copy_tail(K, DST_K, k_tok, dk_tok, i * BLOCK_HK, stride_k_h, N_K_HEADS, HEAD_DIM, 2 * HALF, TAIL,
                           t_mask, BLOCK_HK, BLOCK_TAIL)


@functools.lru_cache(maxsize=256)
def _config(seq_len, n_q_heads, n_k_heads, head_dim, rot, backward, to_dst, tokens, head_tile, elems_per_thread):
    """Programs per sequence and the kernel's constexprs + num_warps, cached per shape and tiling knobs: at
    Llama sizes one autograd step of rope costs the host more time than the GPU, so the launch path stays lean."""
    block_r = pow2(rot // 2)
    block_t = min(tokens, pow2(seq_len))
    max_heads = max(1, head_tile // block_r)
    block_hq, block_hk = min(pow2(n_q_heads), max_heads), min(pow2(n_k_heads), max_heads)
    tail = head_dim - rot
    elems = block_t * (block_hq + block_hk) * block_r * 2
    meta = dict(
        N_Q_HEADS=n_q_heads, N_K_HEADS=n_k_heads, HEAD_DIM=head_dim, HALF=rot // 2, TAIL=tail if to_dst else 0,
        BACKWARD=backward, TO_DST=to_dst, BLOCK_T=block_t, N_TILES=max(-(-n_q_heads // block_hq), -(-n_k_heads // block_hk)),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_R=block_r, BLOCK_TAIL=pow2(max(tail, 1)),
        num_warps=min(16, pow2(-(-elems // (32 * elems_per_thread)))),
    )
    return -(-seq_len // block_t), meta


def _token_stride(x: torch.Tensor) -> int | None:
    """The spacing of tokens when x (B, T, H, D) has its heads back to back and its tokens evenly spaced in
    b·T + t order (contiguous, or a head slice of a packed (B, T, W) tensor): the layout the backward writes.
    None for any other layout. (Strides of size-1 dims are arbitrary, hence the cases.)"""
    b, t, h, d = x.shape
    sb, st, sh, sd = x.stride()  # one call: each stride(i) costs as much host time as all four
    if (h > 1 and sh != d) or (d > 1 and sd != 1):
        return None
    if t == 1:
        return sb
    return st if b == 1 or sb == t * st else None


@on_input_device  # a cuda:1 input must not run on the current cuda:0 (Triton launches there)
def _launch(q, k, cos, sin, dst_q, dst_k, backward: bool, to_dst: bool | None = None) -> None:
    """Rotate q, k (B, T, H, D). Forward: in place (dst_q is q, dst_k is k). Backward: the transpose into fresh
    token-major dst_q, dst_k (pass-through tail included); q/k are then the incoming gradients, any strides.
    to_dst=True with the forward: the rotation into fresh dst_q, dst_k (the custom op's, which may not write q, k)."""
    to_dst = backward if to_dst is None else to_dst
    bsz, seq_len, n_q_heads, head_dim = q.shape
    n_k_heads, rot = k.shape[2], cos.shape[-1]
    if bsz * seq_len == 0:
        return
    if to_dst:
        dq_stride, dk_stride = _token_stride(dst_q), _token_stride(dst_k)
        assert dq_stride is not None and dk_stride is not None, "the kernel writes token-major outputs"
    else:
        assert dst_q is q and dst_k is k, "the forward rotates in place"
        dq_stride = dk_stride = 0
    if not use_triton(q, k, cos, sin):
        for src, dst in ((q, dst_q), (k, dst_k)):
            if backward:
                h = rot // 2
                dst.copy_(_rotate_reference(src, cos, -torch.cat((sin[..., h:], sin[..., :h]), dim=-1)))
            elif to_dst:
                dst.copy_(_rotate_reference(src, cos, sin))
            else:
                dst[..., :rot].copy_(_rotate_reference(src[..., :rot], cos, sin))
        return
    cos_strides = cos.stride()
    if cos_strides != sin.stride() or cos_strides[2] != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_strides = cos.stride()
    blocks_per_seq, meta = _config(seq_len, n_q_heads, n_k_heads, head_dim, rot, backward, to_dst,
                                   TUNING.tokens_per_program, TUNING.head_tile, TUNING.elems_per_thread)
    q_strides, k_strides = q.stride(), k.stride()
    launch(_rope_kernel, (bsz * blocks_per_seq,),
           [q, k, dst_q, dst_k, cos, sin, seq_len, *q_strides[:3], *k_strides[:3],
            cos_strides[0] if cos.shape[0] > 1 else 0, cos_strides[1],  # a batch of one broadcasts
            dq_stride, dk_stride],
           meta)


def _unit_last_stride(grad: torch.Tensor) -> torch.Tensor:
    """Incoming dq/dk may be expanded (stride 0) or transposed; the kernel needs only a unit stride along D."""
    return grad if grad.stride(-1) == 1 else grad.contiguous()


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        _launch(q, k, cos, sin, q, k, backward=False)
        ctx.save_for_backward(cos, sin)
        return q.view_as(q), k.view_as(k)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_out = torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
        dk_out = torch.empty(dk.shape, dtype=dk.dtype, device=dk.device)
        dq, dk = _unit_last_stride(dq), _unit_last_stride(dk)
        _launch(dq, dk, cos, sin, dq_out, dk_out, backward=True)
        return dq_out, dk_out, None, None


class _RoPEPackedFunction(torch.autograd.Function):
    """Rotate q and k in place inside a packed projection output qkv (B, T, (Hq + 2·Hkv)·D) and return the
    q, k, v head views. Its backward assembles d qkv in one fresh tensor: the rotation's transpose writes dq, dk
    straight into their slices and dv is copied into its own. Slicing qkv under autograd instead would
    materialise a zero-filled qkv-sized gradient per slice and add the three (3 fills, 3 copies, 2 adds)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q_heads, n_kv_heads, head_dim):
        q, k, v = _split_heads(qkv, n_q_heads, n_kv_heads, head_dim)
        _launch(q, k, cos, sin, q, k, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.heads = (n_q_heads, n_kv_heads, head_dim)
        return q, k, v

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return _packed_grad(dq, dk, dv, cos, sin, *ctx.heads), None, None, None, None, None


def _packed_grad(dq, dk, dv, cos, sin, n_q_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """d qkv (B, T, W) in one fresh tensor from the gradients of the q, k, v head views (None: unused, zero)."""
    like = next(g for g in (dq, dk, dv) if g is not None)
    dqkv = torch.empty((like.shape[0], like.shape[1], (n_q_heads + 2 * n_kv_heads) * head_dim), dtype=like.dtype,
                       device=like.device)
    dst_q, dst_k, dst_v = _split_heads(dqkv, n_q_heads, n_kv_heads, head_dim)
    dq = torch.zeros_like(dst_q) if dq is None else _unit_last_stride(dq)
    dk = torch.zeros_like(dst_k) if dk is None else _unit_last_stride(dk)
    _launch(dq, dk, cos, sin, dst_q, dst_k, backward=True)
    if dv is None:
        dst_v.zero_()
    else:
        dst_v.copy_(dv)
    return dqkv


def _heads_like(x: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous (B, T, H, D) tensor shaped as x: where the ops write rotated q / k."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rotated(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _heads_like(q), _heads_like(k)
    _launch(q, k, cos, sin, q_out, k_out, backward=False, to_dst=True)
    return q_out, k_out


@custom_op("rope")
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of q and k into fresh tensors (_custom_ops.py: an op with autograd may not write its inputs)."""
    return _rotated(q, k, cos, sin)


@_rope_op.register_fake
def _(q, k, cos, sin):
    return _heads_like(q), _heads_like(k)


@custom_op("rope_backward")
def _rope_backward_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_RoPEFunction's backward: the transposed rotation into fresh gradients."""
    dq_out, dk_out = _heads_like(dq), _heads_like(dk)
    _launch(_unit_last_stride(dq), _unit_last_stride(dk), cos, sin, dq_out, dk_out, backward=True)
    return dq_out, dk_out


@_rope_backward_op.register_fake
def _(dq, dk, cos, sin):
    return _heads_like(dq), _heads_like(dk)


def _rope_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[2:4])


def _rope_backward(ctx, dq, dk):
    refuse_double_backward("rope")
    return (*_rope_backward_op(dq, dk, *ctx.saved_tensors), None, None)


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


@custom_op("rope_packed")
def _rope_packed_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int, n_kv_heads: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q, k and a copy of v (B, T, H, D), each a fresh tensor (outputs may not be views of qkv)."""
    q, k, v = _split_heads(qkv, n_q_heads, n_kv_heads, head_dim)
    return (*_rotated(q, k, cos, sin), v.clone(memory_format=torch.contiguous_format))


@_rope_packed_op.register_fake
def _(qkv, cos, sin, n_q_heads, n_kv_heads, head_dim):
    return tuple(_heads_like(x) for x in _split_heads(qkv, n_q_heads, n_kv_heads, head_dim))


@custom_op("rope_packed_backward")
def _rope_packed_backward_op(dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
                             cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int, n_kv_heads: int,
                             head_dim: int) -> torch.Tensor:
    """_RoPEPackedFunction's backward: d qkv in one fresh tensor."""
    return _packed_grad(dq, dk, dv, cos, sin, n_q_heads, n_kv_heads, head_dim)


@_rope_packed_backward_op.register_fake
def _(dq, dk, dv, cos, sin, n_q_heads, n_kv_heads, head_dim):
    like = next(g for g in (dq, dk, dv) if g is not None)
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    return torch.empty((like.shape[0], like.shape[1], width), dtype=like.dtype, device=like.device)


def _rope_packed_setup(ctx, inputs, output) -> None:
    _, cos, sin, *ctx.heads = inputs
    ctx.save_for_backward(cos, sin)
    ctx.set_materialize_grads(False)  # an unused q, k or v gets no zero-filled gradient, as in the Function


def _rope_packed_backward(ctx, dq, dk, dv):
    refuse_double_backward("rope_packed")
    if dq is None and dk is None and dv is None:
        return None, None, None, None, None, None
    return _rope_packed_backward_op(dq, dk, dv, *ctx.saved_tensors, *ctx.heads), None, None, None, None, None


_rope_packed_op.register_autograd(_rope_packed_backward, setup_context=_rope_packed_setup)


def _split_heads(qkv: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int):
    # view, not Tensor.unflatten: unflatten is a Python method whose super() call dynamo cannot trace under a
    # torch.device(...) context, which would break the compiled graph there.
    q_end, k_end = n_q_heads * head_dim, (n_q_heads + n_kv_heads) * head_dim
    lead = qkv.shape[:-1]
    q = qkv[..., :q_end].view(*lead, n_q_heads, head_dim)
    k = qkv[..., q_end:k_end].view(*lead, n_kv_heads, head_dim)
    return q, k, qkv[..., k_end:].view(*lead, n_kv_heads, head_dim)


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
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("rope gives no gradient to cos/sin; compute them without grad (they come from inv_freq)")
    if not torch.compiler.is_compiling():  # traced, the rotation is out of place (and pointers do not exist)
        _check_in_place(q, k)


def _check_in_place(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.numel() and q.data_ptr() == k.data_ptr():
        raise ValueError("q and k alias the same memory; rope rotates them in place")
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
    if torch.compiler.is_compiling():
        # The op is functional (_custom_ops.py); copying its result back keeps this function's in-place contract,
        # and autograd routes the gradient through the copies.
        q_rot, k_rot = _rope_op(q, k, cos, sin)
        return q.copy_(q_rot), k.copy_(k_rot)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _RoPEFunction.apply(q, k, cos, sin)
    _launch(q, k, cos, sin, q, k, backward=False)
    return q, k


def rope_packed(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a packed projection output qkv (B, T, (Hq + 2·Hkv)·D) = [q | k | v] into (B, T, H, D) head views,
    rotating q and k in place (as :func:`rope`); returns (q, k, v). Under autograd the gradient of qkv is built
    in one tensor (no per-slice zero-filled gradients). qkv must be a projection output nothing else saved.
    While torch.compile traces, q, k and v come back as fresh tensors and qkv is left unrotated (the custom op is
    functional, and no caller reads qkv again)."""
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    if qkv.dim() != 3 or qkv.shape[-1] != width:
        raise ValueError(f"qkv must be (B, T, {width}) for {n_q_heads} q and {n_kv_heads} kv heads of {head_dim}, "
                         f"got {tuple(qkv.shape)}")
    q, k, v = _split_heads(qkv, n_q_heads, n_kv_heads, head_dim)
    _check(q, k, cos, sin)
    if qkv.numel() and torch.compiler.is_compiling():
        return _rope_packed_op(qkv, cos, sin, n_q_heads, n_kv_heads, head_dim)
    if qkv.numel() and torch.is_grad_enabled() and qkv.requires_grad:
        return _RoPEPackedFunction.apply(qkv, cos, sin, n_q_heads, n_kv_heads, head_dim)
    _launch(q, k, cos, sin, q, k, backward=False)
    return q, k, v
