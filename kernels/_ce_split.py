"""The one-read cross-entropy kernel: each row of logits split over several programs that hold their slice in
registers, meet once to combine their softmax statistics, and write the gradient from what they hold.

Why: the row kernel (_ce_core.py) reads every logit twice (online softmax, then the gradient), 6 B per bf16 logit;
a whole 128K-entry row does not fit one program's registers (Triton has no shared-memory staging, and one SM's
registers are 256 KB). Split into P slices of SLICE entries (P = ⌈V / SLICE⌉, e.g. 8 × 16K at V = 128256), each
slice fits a program's registers, so the logits are read once and the gradient written once: 4 B per logit,
the floor. Per row, with part k holding x over its slice (fp32, after the softcap):
  m_k = max(x_t, max_j x_j),   s_k = Σ_{j≠t} e^{x_j − m_k},   (Σ_j x_j and #{x_j > x_t} for smoothing / rank)
and every part combines all P of them:  M = max_k m_k,  S' = Σ_k s_k·e^{m_k − M},  then lse, q and the gradient
exactly as the row kernel does (same formulas, _ce_core.py's docstring), from its own registers.

Meeting point. Each part stores its four statistics, then increments the row's counter (release); it spins on the
counter (acquire) until all P have arrived. Waiting on programs that may not have started is safe only if they
are guaranteed to start: each program takes its (row, part) from a ticket counter (an atomic increment at entry)
instead of its program id, so the parts of a row are always taken by programs that are already running, in
ticket order. At any moment at most one row has only some of its parts taken, every other started row has all
of its parts running and finishes, and so the GPU needs room for only P programs at once — whatever else runs
beside this kernel and whatever order the hardware starts programs in.

Two launches instead (PHASE 1 then 2, the same code): statistics first, then combine + gradient, re-reading the
slice (and the target's logit from the statistics: with the gradient written in place, another part of the row
may already have overwritten it). The Triton interpreter runs programs one after another, so a part would wait forever for its partners;
there the two-launch form runs instead, or the one-launch form with one part per row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._ce_math import log1p, softcap_tanh


@triton.jit
def _ce_split_kernel(
    LOGITS, GRAD, LABELS, LOSS, LSE, Q, RANK, SCALE, STATS, SYNC, n_rows,
    stride_logits_row, stride_grad_row, stride_scale,
    ignore_index, label_smoothing, z_loss, softcap,
    N_COLS: tl.constexpr, PARTS: tl.constexpr, PARTS_P2: tl.constexpr, SLICE: tl.constexpr, PHASE: tl.constexpr,
    WITH_RANK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
):
    # PHASE 0: one launch (statistics, meet, gradient). 1: statistics only. 2: combine + gradient.
    if PHASE == 0:
        ticket = tl.atomic_add(SYNC + n_rows, 1, sem="relaxed").to(tl.int64)  # SYNC[n_rows]: the ticket counter
    else:
        ticket = tl.program_id(0).to(tl.int64)
    row = ticket // PARTS
    part = (ticket % PARTS).to(tl.int32)
    X = LOGITS + row * stride_logits_row
    G = GRAD + row * stride_grad_row
    ST = STATS + row * (5 * PARTS_P2)  # per row: m, s, Σx, rank [PARTS_P2 each], then x_t (two-launch form)
    cols = part * SLICE + tl.arange(0, SLICE)
    mask = cols < N_COLS
    label = tl.load(LABELS + row).to(tl.int64)
    if label != ignore_index:
        target = label.to(tl.int32)  # < V: labels were range-checked on the host
        x = tl.load(X + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_SOFTCAP:
            x, dcap = softcap_tanh(x, softcap)
        if PHASE == 2:  # the logits may hold gradients by now (GRAD == LOGITS): the target's logit from phase 1
            x_t = tl.load(ST + 4 * PARTS_P2)
        else:
            x_t = tl.load(X + target).to(tl.float32)
            if HAS_SOFTCAP:
                x_t = softcap_tanh(x_t, softcap)[0]
            if PHASE == 1 and part == 0:
                tl.store(ST + 4 * PARTS_P2, x_t)
        if PHASE != 2:
            xm = tl.where(mask, x, float("-inf"))
            m = tl.maximum(tl.max(xm, 0), x_t)
            tl.store(ST + part, m)
            tl.store(ST + PARTS_P2 + part, tl.sum(tl.where(cols == target, 0.0, tl.exp(xm - m)), 0))
            if HAS_SMOOTHING:
                tl.store(ST + 2 * PARTS_P2 + part, tl.sum(tl.where(mask, x, 0.0), 0))
            if WITH_RANK:  # a count ≤ V < 2²⁴ is exact in fp32
                tl.store(ST + 3 * PARTS_P2 + part, tl.sum((xm > x_t).to(tl.float32), 0))
        if PHASE == 0:
            tl.debug_barrier()  # every thread's statistics stored before the counter says so
            arrived = tl.atomic_add(SYNC + row, 1, sem="release") + 1
            while arrived < PARTS:
                arrived = tl.atomic_add(SYNC + row, 0, sem="acquire")
            tl.debug_barrier()
        if PHASE != 1:
            k = tl.arange(0, PARTS_P2)
            have = k < PARTS
            # .cg: from L2, where the partners' stores are (L1 is not coherent across SMs)
            m_k = tl.load(ST + k, mask=have, other=float("-inf"), cache_modifier=".cg")
            s_k = tl.load(ST + PARTS_P2 + k, mask=have, other=0.0, cache_modifier=".cg")
            m = tl.max(m_k, 0)
            s_other = tl.sum(s_k * tl.exp(m_k - m), 0)
            e_t = tl.exp(x_t - m)
            log_s = log1p(s_other + (e_t - 1.0))  # S = S' + e_t ≥ 1: the max term is e^0
            lse = m + log_s
            q = s_other / (s_other + e_t)
            if part == 0:
                loss = (1.0 - label_smoothing) * (log_s + (m - x_t))
                if HAS_SMOOTHING:
                    sum_x = tl.sum(tl.load(ST + 2 * PARTS_P2 + k, mask=have, other=0.0, cache_modifier=".cg"), 0)
                    loss += label_smoothing * (lse - sum_x / N_COLS)
                loss += z_loss * lse * lse
                tl.store(LOSS + row, loss)
                tl.store(LSE + row, lse)
                tl.store(Q + row, q)
                if WITH_RANK:
                    rank = tl.sum(tl.load(ST + 3 * PARTS_P2 + k, mask=have, other=0.0, cache_modifier=".cg"), 0)
                    tl.store(RANK + row, rank.to(tl.int32))
            scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
            p = tl.exp(x - lse)
            zc = 2.0 * z_loss * lse
            g = tl.where(cols == target, p * zc - q + label_smoothing, p + p * zc) - label_smoothing / N_COLS
            if HAS_SOFTCAP:
                g = g * dcap
            tl.store(G + cols, (g * scale).to(GRAD.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    elif PHASE != 1:  # an ignored row: loss 0, zero gradient; no statistics, so no meeting either
        if part == 0:
            tl.store(LOSS + row, 0.0)
            tl.store(LSE + row, 0.0)
            tl.store(Q + row, 0.0)
            if WITH_RANK:
                tl.store(RANK + row, -1)
        tl.store(G + cols, tl.zeros([SLICE], dtype=GRAD.dtype.element_ty), mask=mask, eviction_policy="evict_first")


def launch_split(logits, labels, grad, loss, lse, q, rank, scale, stats, sync, *, slice_cols: int, warps: int,
                 one_launch: bool, ignore_index: int, label_smoothing: float, z_loss: float,
                 softcap: float | None) -> None:
    """Forward + gradient of logits (rows, V) in one read (one_launch) or two launches (see the module docstring).

    stats: fp32 scratch of ≥ rows · 5 · pow2(P) entries; sync: int32 zeros of rows + 1 (one_launch only)."""
    rows, n_cols = logits.shape
    parts = triton.cdiv(n_cols, slice_cols)
    args = (logits, grad, labels, loss, lse, q, rank if rank is not None else lse, scale, stats, sync, rows,
            logits.stride(0), grad.stride(0), scale.stride(0) if scale.dim() else 0,
            ignore_index, float(label_smoothing), float(z_loss), float(softcap or 1.0))
    meta = dict(N_COLS=n_cols, PARTS=parts, PARTS_P2=triton.next_power_of_2(parts), SLICE=slice_cols,
                WITH_RANK=rank is not None, HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0,
                num_warps=warps)
    for phase in (0,) if one_launch else (1, 2):
        _ce_split_kernel[(rows * parts,)](*args, PHASE=phase, **meta)
