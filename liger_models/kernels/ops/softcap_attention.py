"""Causal attention with Gemma 2's score soft-cap as a Triton FlashAttention, forward and backward.

Math, per batch row b and query head h (GQA: kv head h // (Hq/Hkv)), query i, key j, head_dim D:
  s_ij = c·tanh(scale·(q_i·k_j) / c)                    fp32 (FlashAttention's and flex's soft-cap; HF eager
                                                         rounds the capped score to the activation dtype first)
  allowed(i, j) = j ≤ i  and  i − j < W (window)  and  doc_i == doc_j (packed documents)
  lse_i = log Σ_{allowed j} exp(s_ij),  p_ij = exp(s_ij − lse_i),  o_i = Σ_j p_ij·v_j
Backward, with δ_i = Σ_d o_id·do_id:
  dv_j = Σ_i p_ij·do_i,  dp_ij = do_i·v_j,  ds_ij = p_ij·(dp_ij − δ_i)·(1 − tanh²)·scale
  dq_i = Σ_j ds_ij·k_j,  dk_j = Σ_i ds_ij·q_i
p is rounded to v's dtype before its product with v (and ds to q's before theirs), as every FlashAttention does;
fp32 inputs keep fp32 products (IEEE, no TF32).

Kernels (FlashAttention-2's schedule): the forward runs one program per block of queries and query head, walking the
key blocks that block may see (from the window's first key to the diagonal) with an online softmax, and writes o and
the fp32 lse. The backward runs two kernels so that nothing accumulates through atomics: one program per key block
and kv head walks the query blocks of every query head of its group (dk, dv); one per query block and query head
walks the key blocks (dq), and first takes its queries' δ, which the dk / dv kernel, launched after it, reads.
Saved for backward: q, k, v, o and lse (B, Hq, T); never a T×T tensor.

Layout: q, k, v are (B, H, T, D) with a unit last stride, any other strides (the transposed (B, T, H, D) views of
the packed projection output are read in place). o and the gradients are written (B, T, H, D) and returned as
(B, H, T, D) views, so the o_proj that follows reshapes them for free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._custom_ops import custom_op, refuse_double_backward
from .._dispatch import once_differentiable, use_triton
from .._launch import cdiv, launch, on_input_device, pow2
from ._ce_core import _softcap
from ._dot import dot, dot_flags


@dataclass(frozen=True)
class SoftcapAttentionTuning:
    """Launch settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    fwd_block_m: int = 64  # queries per forward / dq program
    fwd_block_n: int = 64  # keys per step of the forward / dq loop
    bwd_block_m: int = 32  # queries per step of the dk/dv loop
    bwd_block_n: int = 64  # keys per dk/dv program
    num_warps: int = 4
    # head_dim above 128 (Gemma 2 2B / 9B: 256): half the key blocks (the dk / dv accumulators are BLOCK_N × D fp32
    # in registers), twice the warps
    fwd_block_n_wide: int = 32
    bwd_block_n_wide: int = 32
    num_warps_wide: int = 8
    num_stages: int = 2
    # The dk/dv kernel's own. Pipelined (2 stages: Triton 3.6 prefetches the next query block's lse, δ and document
    # ids) at 32 × 64 blocks and 4 warps it gave a different dk on every run of the same inputs on an H100
    # (2026-12-05, BENCHMARKS.md "Soft-capped attention"), up to 5x eager's bf16 error; with one stage the runs
    # agree bit for bit (tests/kernels/test_softcap_attention.py) and dk's error is half eager's.
    dkdv_num_stages: int = 1
    # Loops over the blocks that need no mask (below the diagonal, inside the window; not with documents) apart from
    # those that do, which alone compute the mask
    split_masked: bool = True
    # Whether the models' attention takes this kernel for soft-capped CUDA training calls instead of flex_attention
    # (modules/attention.py attend). Measured on an H100 (2026-12-05, BENCHMARKS.md "Soft-capped attention"): the
    # same Gemma-2-9B-width step (31.1k tokens/s with flex, 30.9k with the kernel, 26.1 GiB both), no compile at
    # start, and 1.4-2.5x faster than flex wherever flex runs recompiled for a second shape.
    preferred: bool = True


TUNING = SoftcapAttentionTuning()


def softcap_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                                window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """The module docstring's math in PyTorch, scores and softmax in fp32 (float64 inputs stay float64: the tests'
    truth); forms the (B, Hq, T, T) scores."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~_allowed(q.shape[2], window, documents, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.to(wide)).to(q.dtype)


def _allowed(t: int, window: int | None, documents: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j < window)
    if documents is not None:
        ok = ok[None] & (documents[:, :, None] == documents[:, None, :])
        return ok[:, None]  # (B, 1, T, T)
    return ok


@triton.jit
def _scores(q, k, qi, kj, doc_q, doc_k, T, scale, softcap, window, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_DOCS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """(capped scores, −inf where not allowed, and d capped / d raw score = 1 − tanh²) of a query × key tile.
    MASKED off: a tile every pair of which is allowed (below the diagonal, inside the window, no documents)."""
    s = dot(q, tl.trans(k), IEEE, UPCAST) * scale
    s, dcap = _softcap(s, softcap)
    if MASKED:
        ok = (kj[None, :] <= qi[:, None]) & (qi < T)[:, None]  # kj ≤ qi < T: kj < T too
        if HAS_WINDOW:
            ok = ok & (qi[:, None] - kj[None, :] < window)
        if HAS_DOCS:
            ok = ok & (doc_q[:, None] == doc_k[None, :])
        s = tl.where(ok, s, float("-inf"))
    return s, dcap


@triton.jit
def _load_tile(X, rows, cols, stride_t, T, D: tl.constexpr):
    return tl.load(X + rows[:, None] * stride_t + cols[None, :], mask=(rows < T)[:, None] & (cols < D)[None, :],
                   other=0.0)


@triton.jit
def _key_ranges(start_m, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """lo ≤ a ≤ start_m ≤ hi: the key blocks a block of queries starting at start_m may see are [lo, hi); those in
    [a, start_m) need no mask (below the diagonal and wholly inside every query's window). BLOCK_N divides BLOCK_M."""
    lo = 0
    a = 0
    if HAS_WINDOW:
        lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
        a = tl.minimum(tl.maximum(start_m + BLOCK_M - window + BLOCK_N - 1, lo) // BLOCK_N * BLOCK_N, start_m)
    return lo, a, tl.minimum(start_m + BLOCK_M, T)


@triton.jit
def _query_ranges(start_n, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """lo ≤ b ≤ e ≤ hi: the query blocks that see a key of the block starting at start_n are [lo, hi); those in
    [b, e) need no mask (past the block's last key, and its first key inside all their windows). BLOCK_M divides
    BLOCK_N."""
    lo = start_n
    b = tl.minimum(start_n + BLOCK_N, T)
    hi = T
    e = T
    if HAS_WINDOW:  # the last query that sees a key of this block is start_n + BLOCK_N − 1 + W − 1
        hi = tl.minimum(T, start_n + BLOCK_N - 1 + window)
        last = start_n + window - BLOCK_M - b  # query blocks starting at ≤ b + last see the block's first key
        e = tl.minimum(hi, b + tl.where(last >= 0, last // BLOCK_M + 1, 0) * BLOCK_M)
    return lo, b, tl.maximum(e, b), hi


@triton.jit
def _query_block(Q, DOC, sq_b, sq_h, sq_t, sdoc_b, T, HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, HAS_DOCS: tl.constexpr):
    """This program's block of queries (grid: query blocks × B·Hq): its first index, b·Hq + h, b, h, the query
    indices, the feature indices, the q tile, the batch row's document ids and the queries' ones."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // HQ, bh % HQ
    qi = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * sq_b + h * sq_h, qi, d, sq_t, T, D)
    DOC_B = DOC + b * sdoc_b
    doc_q = 0
    if HAS_DOCS:
        doc_q = tl.load(DOC_B + qi, mask=qi < T, other=-1)
    return start_m, bh, b, h, qi, d, q, DOC_B, doc_q


@triton.jit
def _key_block(K, V, DOC_B, start_n, d, sk_t, sv_t, T, D: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_DOCS: tl.constexpr):
    """The key indices, k and v tiles and document ids of the key block starting at start_n."""
    kj = start_n + tl.arange(0, BLOCK_N)
    doc_k = 0
    if HAS_DOCS:
        doc_k = tl.load(DOC_B + kj, mask=kj < T, other=-2)
    return kj, _load_tile(K, kj, d, sk_t, T, D), _load_tile(V, kj, d, sv_t, T, D), doc_k


@triton.jit
def _fwd_step(acc, m_i, l_i, q, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale, softcap, window,
              D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_DOCS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the forward's online softmax."""
    kj, k, v, doc_k = _key_block(K, V, DOC_B, start_n, d, sk_t, sv_t, T, D, BLOCK_N, HAS_DOCS)
    s, _ = _scores(q, k, qi, kj, doc_q, doc_k, T, scale, softcap, window, MASKED, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet: exp(−inf) = 0
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, DOC, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                sdoc_b, T, scale, softcap, window, HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    start_m, bh, b, h, qi, d, q, DOC_B, doc_q = _query_block(Q, DOC, sq_b, sq_h, sq_t, sdoc_b, T, HQ, D, BLOCK_D,
                                                              BLOCK_M, HAS_DOCS)
    K += b * sk_b + (h // GROUP) * sk_h
    V += b * sv_b + (h // GROUP) * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, a, hi = _key_ranges(start_m, T, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if SPLIT:  # masks only where the window's edge or the diagonal crosses a block
        for start_n in range(lo, a, BLOCK_N):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale,
                                      softcap, window, D, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
        for start_n in range(a, start_m, BLOCK_N):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale,
                                      softcap, window, D, BLOCK_N, False, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
        for start_n in range(start_m, hi, BLOCK_N):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale,
                                      softcap, window, D, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale,
                                      softcap, window, D, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # rows past T only: every real query sees itself
    o = acc / l_safe[:, None]
    O += b * so_b + h * so_h
    tl.store(O + qi[:, None] * so_t + d[None, :], o.to(O.dtype.element_ty),
             mask=(qi < T)[:, None] & (d < D)[None, :])
    tl.store(LSE + bh * T + qi, m_i + tl.log(l_safe), mask=qi < T)


@triton.jit
def _dkdv_step(dk, dv, k, v, kj, doc_k, Qh, DOh, LSE_H, DELTA_H, DOC_B, start_m, d, sq_t, sdo_t, T, scale, softcap,
               window, D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_DOCS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One query block's share of a key block's dk and dv (rows past T load zeros: p·do = 0 and dp = δ = 0)."""
    qi = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(Qh, qi, d, sq_t, T, D)
    do = _load_tile(DOh, qi, d, sdo_t, T, D)
    lse = tl.load(LSE_H + qi, mask=qi < T, other=0.0)
    delta = tl.load(DELTA_H + qi, mask=qi < T, other=0.0)
    doc_q = 0
    if HAS_DOCS:
        doc_q = tl.load(DOC_B + qi, mask=qi < T, other=-1)
    s, dcap = _scores(q, k, qi, kj, doc_q, doc_k, T, scale, softcap, window, MASKED, HAS_WINDOW, HAS_DOCS, IEEE,
                      UPCAST)
    p = tl.exp(s - lse[:, None])
    dv += dot(tl.trans(p.to(do.dtype)), do, IEEE, UPCAST)
    ds = p * (dot(do, tl.trans(v), IEEE, UPCAST) - delta[:, None]) * dcap * scale
    dk += dot(tl.trans(ds.to(q.dtype)), q, IEEE, UPCAST)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DOC, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                     sdo_b, sdo_h, sdo_t, sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, sdoc_b, T, scale, softcap, window,
                     HQ: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    b, hk = bh // HKV, bh % HKV
    kj = start_n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * sk_b + hk * sk_h, kj, d, sk_t, T, D)
    v = _load_tile(V + b * sv_b + hk * sv_h, kj, d, sv_t, T, D)
    DOC_B = DOC + b * sdoc_b
    doc_k = 0
    if HAS_DOCS:
        doc_k = tl.load(DOC_B + kj, mask=kj < T, other=-2)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, mid, end, hi = _query_ranges(start_n, T, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for g in range(GROUP):
        h = hk * GROUP + g
        Qh = Q + b * sq_b + h * sq_h
        DOh = DO + b * sdo_b + h * sdo_h
        LSE_H = LSE + (b * HQ + h) * T
        DELTA_H = DELTA + (b * HQ + h) * T
        if SPLIT:
            for start_m in range(lo, mid, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, k, v, kj, doc_k, Qh, DOh, LSE_H, DELTA_H, DOC_B, start_m, d, sq_t, sdo_t,
                                    T, scale, softcap, window, D, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
            for start_m in range(mid, end, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, k, v, kj, doc_k, Qh, DOh, LSE_H, DELTA_H, DOC_B, start_m, d, sq_t, sdo_t,
                                    T, scale, softcap, window, D, BLOCK_M, False, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
            for start_m in range(end, hi, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, k, v, kj, doc_k, Qh, DOh, LSE_H, DELTA_H, DOC_B, start_m, d, sq_t, sdo_t,
                                    T, scale, softcap, window, D, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
        else:
            for start_m in range(lo, hi, BLOCK_M):
                dk, dv = _dkdv_step(dk, dv, k, v, kj, doc_k, Qh, DOh, LSE_H, DELTA_H, DOC_B, start_m, d, sq_t, sdo_t,
                                    T, scale, softcap, window, D, BLOCK_M, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
    mask = (kj < T)[:, None] & (d < D)[None, :]
    tl.store(DK + b * sdk_b + hk * sdk_h + kj[:, None] * sdk_t + d[None, :], dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + b * sdv_b + hk * sdv_h + kj[:, None] * sdv_t + d[None, :], dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_step(dq, q, do, lse, delta, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale, softcap, window,
             D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
             HAS_DOCS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One key block's share of a query block's dq."""
    kj, k, v, doc_k = _key_block(K, V, DOC_B, start_n, d, sk_t, sv_t, T, D, BLOCK_N, HAS_DOCS)
    s, dcap = _scores(q, k, qi, kj, doc_q, doc_k, T, scale, softcap, window, MASKED, HAS_WINDOW, HAS_DOCS, IEEE,
                      UPCAST)
    p = tl.exp(s - lse[:, None])
    ds = p * (dot(do, tl.trans(v), IEEE, UPCAST) - delta[:, None]) * dcap * scale
    return dq + dot(ds.to(k.dtype), k, IEEE, UPCAST)


@triton.jit
def _bwd_dq_kernel(Q, K, V, O, DO, LSE, DELTA, DQ, DOC, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                   so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, sdq_b, sdq_h, sdq_t, sdoc_b, T, scale, softcap, window,
                   HQ: tl.constexpr,
                   GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr, SPLIT: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr):
    start_m, bh, b, h, qi, d, q, DOC_B, doc_q = _query_block(Q, DOC, sq_b, sq_h, sq_t, sdoc_b, T, HQ, D, BLOCK_D,
                                                              BLOCK_M, HAS_DOCS)
    do = _load_tile(DO + b * sdo_b + h * sdo_h, qi, d, sdo_t, T, D)
    lse = tl.load(LSE + bh * T + qi, mask=qi < T, other=0.0)
    # δ = Σ o·do of these queries, kept for the dk/dv kernel, which runs after this one
    o = _load_tile(O + b * so_b + h * so_h, qi, d, so_t, T, D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * T + qi, delta, mask=qi < T)
    K += b * sk_b + (h // GROUP) * sk_h
    V += b * sv_b + (h // GROUP) * sv_h
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, a, hi = _key_ranges(start_m, T, window, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if SPLIT:
        for start_n in range(lo, a, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale, softcap,
                          window, D, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
        for start_n in range(a, start_m, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale, softcap,
                          window, D, BLOCK_N, False, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
        for start_n in range(start_m, hi, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale, softcap,
                          window, D, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            dq = _dq_step(dq, q, do, lse, delta, qi, doc_q, K, V, DOC_B, start_n, d, sk_t, sv_t, T, scale, softcap,
                          window, D, BLOCK_N, True, HAS_WINDOW, HAS_DOCS, IEEE, UPCAST)
    tl.store(DQ + b * sdq_b + h * sdq_h + qi[:, None] * sdq_t + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=(qi < T)[:, None] & (d < D)[None, :])


def _meta(q: torch.Tensor, k: torch.Tensor, window: int | None, documents: torch.Tensor | None,
          backward_dkdv: bool) -> dict:
    head_dim = q.shape[-1]
    wide = head_dim > 128
    if backward_dkdv:
        block_m, block_n = TUNING.bwd_block_m, TUNING.bwd_block_n_wide if wide else TUNING.bwd_block_n
    else:
        block_m, block_n = TUNING.fwd_block_m, TUNING.fwd_block_n_wide if wide else TUNING.fwd_block_n
    if max(block_m, block_n) % min(block_m, block_n):
        raise ValueError(f"softcap_attention: block sizes {block_m} and {block_n} must divide one another")
    return dict(GROUP=q.shape[1] // k.shape[1], D=head_dim, BLOCK_D=max(16, pow2(head_dim)), BLOCK_M=block_m,
                BLOCK_N=block_n, HAS_WINDOW=window is not None, HAS_DOCS=documents is not None,
                SPLIT=TUNING.split_masked and documents is None and (block_m % block_n == 0 if not backward_dkdv
                                                                      else block_n % block_m == 0),
                **dot_flags(q.dtype),
                num_warps=TUNING.num_warps_wide if wide else TUNING.num_warps,
                # fp32 tiles of 256 columns, double-buffered, would pass an SM's shared memory
                num_stages=1 if wide and q.element_size() == 4 else
                TUNING.dkdv_num_stages if backward_dkdv else TUNING.num_stages)


def _strides(x: torch.Tensor) -> list[int]:
    return [x.stride(0), x.stride(1), x.stride(2)]


def _heads_last(like: torch.Tensor, heads: int) -> torch.Tensor:
    """A (B, heads, T, D) view of fresh (B, T, heads, D) memory."""
    b, _, t, d = like.shape
    return like.new_empty(b, t, heads, d).transpose(1, 2)


def _window_arg(window: int | None) -> int:
    return 0 if window is None else int(window)


def _documents_arg(documents: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, int]:
    if documents is None:
        return q, 0  # never read (HAS_DOCS is off); any pointer will do
    return documents, documents.stride(0)


@on_input_device
def _forward(q, k, v, scale: float, softcap: float, window: int | None, documents: torch.Tensor | None):
    b, hq, t, _ = q.shape
    o = _heads_last(q, hq)
    lse = torch.empty(b, hq, t, dtype=torch.float32, device=q.device)
    if o.numel():
        docs, sdoc = _documents_arg(documents, q)
        meta = _meta(q, k, window, documents, False)
        launch(_fwd_kernel, (cdiv(t, meta["BLOCK_M"]), b * hq),
               [q, k, v, o, lse, docs, *_strides(q), *_strides(k), *_strides(v), *_strides(o), sdoc, t, float(scale),
                float(softcap), _window_arg(window)],
               dict(meta, HQ=hq))
    return o, lse


@on_input_device
def _backward(do, q, k, v, o, lse, scale: float, softcap: float, window: int | None,
              documents: torch.Tensor | None):
    b, hq, t, _ = q.shape
    hkv = k.shape[1]
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(lse)  # (B, Hq, T): written by the dq kernel, read by the dk/dv kernel
    dq, dk, dv = _heads_last(q, hq), _heads_last(k, hkv), _heads_last(v, hkv)
    if dq.numel():
        docs, sdoc = _documents_arg(documents, q)
        qkv_strides = [*_strides(q), *_strides(k), *_strides(v)]
        tail = [sdoc, t, float(scale), float(softcap), _window_arg(window)]
        meta = _meta(q, k, window, documents, False)
        launch(_bwd_dq_kernel, (cdiv(t, meta["BLOCK_M"]), b * hq),
               [q, k, v, o, do, lse, delta, dq, docs, *qkv_strides, *_strides(o), *_strides(do), *_strides(dq),
                *tail], dict(meta, HQ=hq))
        meta = _meta(q, k, window, documents, True)
        launch(_bwd_dkdv_kernel, (cdiv(t, meta["BLOCK_N"]), b * hkv),
               [q, k, v, do, lse, delta, dk, dv, docs, *qkv_strides, *_strides(do), *_strides(dk), *_strides(dv),
                *tail], dict(meta, HQ=hq, HKV=hkv))
    return dq, dk, dv


class _SoftcapAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, softcap, window, documents):
        o, lse = _forward(q, k, v, scale, softcap, window, documents)
        ctx.save_for_backward(q, k, v, o, lse, documents)
        ctx.args = (scale, softcap, window)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, documents = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, *ctx.args, documents)
        return dq, dk, dv, None, None, None, None


@custom_op("softcap_attention")
def _softcap_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                          window: int | None, documents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, scale, softcap, window, documents)


@_softcap_attention_op.register_fake
def _(q, k, v, scale, softcap, window, documents):
    b, hq, t, _ = q.shape
    return _heads_last(q, hq), q.new_empty(b, hq, t, dtype=torch.float32)


@custom_op("softcap_attention_backward")
def _softcap_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   o: torch.Tensor, lse: torch.Tensor, scale: float, softcap: float,
                                   window: int | None, documents: torch.Tensor | None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, scale, softcap, window, documents)


@_softcap_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, scale, softcap, window, documents):
    return _heads_last(q, q.shape[1]), _heads_last(k, k.shape[1]), _heads_last(v, v.shape[1])


def _softcap_attention_setup(ctx, inputs, output) -> None:
    q, k, v, scale, softcap, window, documents = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], documents)
    ctx.args = (scale, softcap, window)


def _softcap_attention_grads(ctx, do, _dlse):
    refuse_double_backward("softcap_attention")
    q, k, v, o, lse, documents = ctx.saved_tensors
    dq, dk, dv = _softcap_attention_backward_op(do, q, k, v, o, lse, *ctx.args, documents)
    return dq, dk, dv, None, None, None, None


_softcap_attention_op.register_autograd(_softcap_attention_grads, setup_context=_softcap_attention_setup)


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                      window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal soft-capped attention (module docstring) for q (B, Hq, T, D), k / v (B, Hkv, T, D) with unit last
    strides → (B, Hq, T, D). window: each query sees its last ``window`` keys (itself included); documents: (B, T)
    integer ids, a query sees only keys of its own document. Autograd-aware in q, k and v."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q must be (B, Hq, T, D) and k, v (B, Hkv, T, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not softcap > 0 or softcap == float("inf"):
        raise ValueError(f"softcap must be a positive finite number, got {softcap}")
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if documents is not None and (documents.shape != (q.shape[0], q.shape[2]) or documents.dtype.is_floating_point):
        raise ValueError(f"documents must be (B, T) = {(q.shape[0], q.shape[2])} integer ids, got "
                         f"{tuple(documents.shape)} {documents.dtype}")
    if not use_triton(q, k, v, documents) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return softcap_attention_reference(q, k, v, scale, softcap, window, documents)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if documents is not None and documents.stride(-1) != 1:
        documents = documents.contiguous()
    if torch.compiler.is_compiling():
        return _softcap_attention_op(q, k, v, float(scale), float(softcap), window, documents)[0]
    return _SoftcapAttention.apply(q, k, v, float(scale), float(softcap), window, documents)
