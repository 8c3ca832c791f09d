"""Attention of a few new tokens over a long KV cache under any mask, split over the keys (forward only, decoding).

Math, for query head h (kv head g = h // G, G = Hq / Hkv, as HF's repeat_kv), token t and keys j < S:
  s_j = scale · q_{h,t} · k_{g,j}        over the keys j with mask[b, t, j] (every other key: −∞)
  out_{h,t} = Σ_j softmax(s)_j · v_{g,j}
Numerics as flash attention: the dot products accumulate in fp32 from the input dtype, the softmax is fp32 (fp64
for fp64 inputs), and the probabilities meet V in V's dtype (fp32 inputs use IEEE fp32 dots, not TF32, so an fp32
model matches SDPA's math within rounding).

Why a kernel: a Medusa step verifies its tree of ~45 candidates in one call over the whole cache. For that many
queries SDPA takes a prefill kernel whose programs cover (head, query block) pairs only: 32 programs on a
132-SM H200, each walking all 2K+ keys. Llama-3-8B's tree attention took 89 µs per layer, 2.9 ms of a 9 ms step
(benchmarks/tools/profile_decode.py), against 8 µs per layer for a one-token step, where cuDNN splits the keys.
Here the keys are split as in flash-decoding:
  1. ``_split_kernel``, programs (batch × kv head, block of the G·T query rows of that kv head, key chunk): an
     online softmax over the chunk; writes the chunk's normalised output and its log-sum-exp (fp32). The rows of a
     program come from all G query heads of its kv head, so GQA reads a K/V tile once per block of BLOCK_M rows,
     not once per query head. A key tile no row may see is skipped after reading its mask: a static cache's
     unfilled slots cost their mask bytes only.
  2. ``_merge_kernel``, one program per (batch, head, token) row (a block of rows under the interpreter):
     out = Σ_chunks exp(lse_c − lse) · out_c.
Measured on an H200 in bf16 (benchmarks/bench_decode_attention.py, one layer, 45 tree nodes, Hq 32 / Hkv 8, D 128):
9.2 / 20.9 / 54.7 µs with 128 / 2K / 8K cached tokens, against SDPA's 21.5 / 94.2 / 323.4 µs.
The mask is AttentionMask's boolean tensor (B or 1, 1, T, S), so the rules (causality, trees, windows, padding)
live in one place (liger_models/modules/attention.py).

Loops with runtime bounds are `while` loops (see rms_norm.py: Triton 3.6's interpreter and NumPy ≥ 2.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import interpreting, use_triton
from ._dot import dot, dot_flags
from .._launch import cdiv, on_input_device, pow2, sm_count


@dataclass(frozen=True)
class DecodeAttentionTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Schedule (benchmarks/bench_decode_attention.py times the alternatives; LIGER_TUNE sets them there).
    block_n: int = 64  # keys per tile
    # query rows per program (halved for heads wider than 128: the fp32 accumulator is BLOCK_M × D)
    block_m_max: int = 64
    num_warps: int = 4
    programs_per_sm: int = 2  # key chunks are sized so that the split kernel has about this many programs per SM
    min_queries: int = 1  # calls with fewer new tokens take SDPA (liger_models/modules/attention.py)
    # (batch, head, token) rows per merge program. One on the GPU: an H200 run of 16 rows with a loop over the chunks
    # took 10.4 / 22.8 / 56.8 µs for the 8B tree cases and 14.4 µs for one token, against 9.2 / 20.9 / 54.7 and 9.5 with
    # one row each. Under the interpreter every program costs Python time, so there rows come in blocks.
    merge_rows: int = 1
    merge_rows_interpreted: int = 64


TUNING = DecodeAttentionTuning()


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """PyTorch reference: q (B, Hq, T, D), k / v (B, Hkv, S, D), mask (B or 1, 1, T, S) bool → (B, Hq, T, D).
    Math in fp32 (float64 stays float64); the output in q's dtype."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    k, v = (t.to(acc).repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.to(acc) @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # a row that sees no key: 0, as SDPA
    return (probs @ v).to(q.dtype)


@triton.jit
def _split_kernel(Q, K, V, MASK, O_PART, LSE_PART,
                  stride_q_b, stride_q_h, stride_q_t, stride_k_b, stride_k_h, stride_k_s,
                  stride_v_b, stride_v_h, stride_v_s, stride_mask_b, stride_mask_t,
                  num_kv_heads, q_len, kv_len, chunk, num_splits, head_dim, scale,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  IEEE: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    pid_bg, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, g = pid_bg // num_kv_heads, pid_bg % num_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # over this kv head's GROUP query heads × q_len tokens
    row_ok = rows < GROUP * q_len
    head, t = g * GROUP + rows // q_len, rows % q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(Q + b.to(tl.int64) * stride_q_b + head[:, None].to(tl.int64) * stride_q_h
                + t[:, None] * stride_q_t + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    K += b.to(tl.int64) * stride_k_b + g.to(tl.int64) * stride_k_h
    V += b.to(tl.int64) * stride_v_b + g.to(tl.int64) * stride_v_h
    MASK += b.to(tl.int64) * stride_mask_b + t[:, None].to(tl.int64) * stride_mask_t

    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    n0 = start
    while n0 < end:
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < end
        allowed = tl.load(MASK + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
        seen_col = tl.max(allowed.to(tl.int32), axis=0) > 0  # keys some row of this block may see
        if tl.max(seen_col.to(tl.int32), axis=0) > 0:
            # Keys no row sees are not read: their values meet a probability of 0, and 0 · NaN would be NaN.
            kv_mask = seen_col[:, None] & d_ok[None, :]
            k = tl.load(K + cols[:, None].to(tl.int64) * stride_k_s + d[None, :], mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k), IEEE, UPCAST)
            s = tl.where(allowed, s.to(ACC) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: no NaN
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + cols[:, None].to(tl.int64) * stride_v_s + d[None, :], mask=kv_mask, other=0.0)
            pv = dot(p.to(v.dtype), v, IEEE, UPCAST)
            acc = acc * alpha[:, None] + pv.to(ACC)
            m_i = m_new
        n0 += BLOCK_N
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # Partials: (B, Hq, T, splits, D) and (B, Hq, T, splits), rows in (b, head, t) order.
    part = ((b * (num_kv_heads * GROUP) + head).to(tl.int64) * q_len + t) * num_splits + split
    tl.store(O_PART + part[:, None] * head_dim + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE_PART + part, lse, mask=row_ok)


@triton.jit
def _merge_kernel(O_PART, LSE_PART, OUT, num_rows, num_heads, q_len, num_splits, head_dim,
                  stride_out_b, stride_out_h, stride_out_t,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b, head, t) rows
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row_ok, d_ok = rows < num_rows, d < head_dim
    row_s_ok = row_ok[:, None] & (s < num_splits)[None, :]
    where_s = rows.to(tl.int64)[:, None] * num_splits + s[None, :]  # (row, chunk) index into LSE_PART
    lse = tl.load(LSE_PART + where_s, mask=row_s_ok, other=float("-inf"))
    top = tl.max(lse, axis=1)
    # A chunk with no visible key weighs 0; a row that sees no key at all gets 0, as SDPA gives it (not NaN).
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)[:, None]))
    total = tl.sum(weight, axis=1)
    part = tl.load(O_PART + where_s[:, :, None] * head_dim + d[None, None, :],
                   mask=row_s_ok[:, :, None] & d_ok[None, None, :], other=0.0)
    out = tl.sum(weight[:, :, None] * part, axis=1) / tl.where(total > 0, total, 1.0)[:, None]
    b, rest = rows // (num_heads * q_len), rows % (num_heads * q_len)
    head, t = rest // q_len, rest % q_len
    where = b.to(tl.int64) * stride_out_b + head.to(tl.int64) * stride_out_h + t * stride_out_t
    tl.store(OUT + where[:, None] + d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _splits(programs: int, kv_len: int, device: torch.device) -> tuple[int, int]:
    """(number of key chunks, keys per chunk): enough programs to fill the GPU, chunks a whole number of tiles."""
    tiles = cdiv(kv_len, TUNING.block_n)
    splits = max(1, min(tiles, cdiv(TUNING.programs_per_sm * sm_count(device), programs)))
    chunk = cdiv(tiles, splits) * TUNING.block_n
    return cdiv(kv_len, chunk), chunk


def runs_kernel(*tensors: torch.Tensor) -> bool:
    """Whether these tensors go through the Triton kernels: CUDA tensors in fp32 / bf16 / fp16 (Triton 3.6 fails to
    lower this kernel's fp64 dots on the GPU; fp64 models there keep SDPA), and CPU tensors under the interpreter
    (fp64 included: the CPU tests' models)."""
    if not use_triton(*tensors):
        return False
    return not tensors[0].is_cuda or tensors[0].dtype in (torch.float32, torch.bfloat16, torch.float16)


@on_input_device
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale, keys allowed by mask) v, no autograd: q (B, Hq, T, D), k / v (B, Hkv, S, D) with
    Hq a multiple of Hkv, mask (B or 1, 1, T, S) bool → (B, Hq, T, D) in q's dtype (0 for a row that sees no key).
    Tensors ``runs_kernel`` refuses take the reference."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)} / v {tuple(v.shape)}")
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:] != (1, T, S) or mask.shape[0] not in (1, B):
        raise ValueError(f"decode_attention: mask must be bool (B or 1, 1, {T}, {S}), got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    if not runs_kernel(q, k, v, mask):
        return decode_attention_reference(q, k, v, mask, scale)
    q, k, v, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, mask))
    mask = mask.view(torch.uint8)  # same bytes; Triton loads them as integers
    group = Hq // Hkv
    block_d = max(16, pow2(D))  # a 16-bit tl.dot needs K ≥ 16 on the GPU
    block_m = min(TUNING.block_m_max if block_d <= 128 else TUNING.block_m_max // 2, max(16, pow2(group * T)))
    row_blocks = cdiv(group * T, block_m)
    splits, chunk = _splits(B * Hkv * row_blocks, S, q.device)
    acc = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (the CPU tests' models)
    o_part = torch.empty(B, Hq, T, splits, D, dtype=acc, device=q.device)
    lse_part = torch.empty(B, Hq, T, splits, dtype=acc, device=q.device)
    _split_kernel[(B * Hkv, row_blocks, splits)](
        q, k, v, mask, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2),
        Hkv, T, S, chunk, splits, D, scale,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=TUNING.block_n, BLOCK_D=block_d, **dot_flags(q.dtype),
        ACC=tl.float64 if acc == torch.float64 else tl.float32, num_warps=TUNING.num_warps)
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    rows = B * Hq * T
    block_r = TUNING.merge_rows_interpreted if interpreting() else TUNING.merge_rows
    _merge_kernel[(cdiv(rows, block_r),)](o_part, lse_part, out, rows, Hq, T, splits, D, out.stride(0),
                                         out.stride(1), out.stride(2), BLOCK_R=block_r, BLOCK_S=pow2(splits),
                                         BLOCK_D=block_d, num_warps=1)
    return out
