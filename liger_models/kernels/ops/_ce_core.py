"""The cross-entropy row kernel shared by cross_entropy.py and fused_linear_cross_entropy.py.

One program per row of logits (N, V). Pass 1 reads the row once with an online softmax and yields
  m = running max,  S' = Σ_{j≠t} e^{x_j − m}  (the target's term kept apart),  e_t = e^{x_t − m},
  lse = m + log1p(S' + e_t − 1),  nll = lse − x_t,  q = 1 − p_t = S' / (S' + e_t),
so neither the loss of a confident token nor its target gradient p_t − 1 = −q is formed by a cancelling
subtraction (in fp32, p_t − 1 is 0 once p_t > 1 − 6e-8; a logit 30 above the rest gives q ≈ V·e⁻³⁰ ≈ 1e-8).
Pass 2 re-reads the row in REVERSE block order (the blocks pass 1 read last are the likeliest still in L2; pass-1
loads of the row's tail are marked evict_last, of its head evict_first (TUNING.keep_l2_share), pass-2 loads and the
gradient stores evict_first) and writes
  g_j = scale · (p_j·(1 + 2z·lse) − ε/V − (1−ε)·[j=t])   with the target entry as −q + p_t·2z·lse + ε − ε/V,
times the softcap derivative 1 − tanh² = 4u/(1+u)², u = e^{−2|x|/c}. Class weights with label smoothing
(CLASS_WEIGHTED, ce_rows' class_smoothing) weigh pass 1's Σx and the gradient's ε/V per column by w_j, one more
read of w per row. `scale` is read from device memory (the
mean's 1/denominator, a loss scale, or a per-row grad_output) so nothing here needs a host sync.

Bytes per element (bf16): pass 1 reads 2, pass 2 reads 2 (partly from L2) and writes 2. Floor (one read + one
write) for 8192×128256 is 4.2 GB → 1.0 ms at 4.2 TB/s; an L2 miss on every pass-2 read costs 1.5 ms.
Reaching that floor needs one read: a 128K-entry row does not fit one program's registers, and holding slices of it
in several programs' registers, persistent grids, a two-launch (partial statistics, then gradient) split and 32K-64K
columns kept in registers between the passes were all slower on the H200 (BENCHMARKS.md, "Cross-entropy"). What is
kept: rows wider than TUNING.split_cols go to 2 (4, ...) programs that each run both passes on a segment and meet once
between them (_ce_meet.py), so a 512 KB row puts no more in flight per SM than a 256 KB one; each program loads the
first block of its pass 2 before the meeting, so that load's latency overlaps the wait (4096×256000: 1.30 → 1.28 ms).

Instructions matter as much as bytes (`benchmarks/tools/sass_report.py ce` reads the sm_90 SASS): the loops issue
~12 (pass 1) + ~8 (pass 2) instructions per logit, where a plain loop issues ~38, because exp is one ex2.ftz, only
the partial last block is masked, only the target's block pays for the target (a branch around whole blocks, which
ptxas cannot if-convert into every block), the sums are reduced per thread (TUNING.lane_sums), and the per-row
constants of the gradient are folded once. With the call's host path out of the way (_labels.py) the kernel runs
8192×128256 in 1.22-1.28 ms on the H200 (2026-11-30), beyond the read-twice floor: L2 serves about half of pass 2's
re-reads; at 4096×256000 (512 KB rows, split into segments) about a quarter, 1.28 ms.
V is a constexpr (one compile per vocabulary size; the whole-block count is then known at compile time, and
Triton's interpreter cannot loop to a runtime bound with numpy ≥ 2.4).
Modes (constexpr): FORWARD (pass 1: loss, lse, q, rank), BACKWARD (pass 2: gradient); FORWARD off means lse and q
come from an earlier forward (reduction="none": the per-row grad_output is only known in backward).
The gradient may be written in place over the logits (GRAD == LOGITS): each element is read before it is
overwritten and no other program touches the row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._ce_meet import _exp, _share_partials, meeting_counters
from .._launch import cdiv, launch, pow2, runs_compiled, sm_count


@dataclass(frozen=True)
class CrossEntropyRowTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Row-kernel tunables for the H200 (benchmarks/bench_cross_entropy.py times variants at the headline shapes):
    # elements per block and warps per row program. With the loop body at ~19 issued instructions per logit (fwd+bwd,
    # sm_90 SASS; ~38 for a plain loop) the kernel is not issue-bound, and wide blocks over 32 warps win: 16384/32
    # (16 logits per thread per block, 32 registers, two programs per SM) was the fastest of {32768/32, 32768/16,
    # 16384/32, 16384/16, 8192/16, 8192/8, 4096/8, 4096/4, 2048/4} at six of seven timed shapes on the H200
    # (2026-11-29), e.g. 8192×128256 1.85 ms (32768/32 2.00, 4096/8 2.07) and 32768×128256 6.13 ms (6.57, 7.34).
    block_v: int = 16384
    num_warps: int = 32
    # Loop switches, timed as variants (benchmarks/bench_cross_entropy.py): pass 2 in reverse block order; L2 eviction
    # hints (pass 1 evict_last, pass 2 and the gradient stores evict_first).
    reverse_pass2: bool = True
    eviction_hints: bool = True
    # Pass 1 keeps per-thread partial sums (reduced across threads once per row) instead of reducing every block, from
    # lane_sums_min_rows rows on. No shuffle or barrier in the loop: 2.5-4.6% faster at 4K-16K rows, and under the
    # register cap below at every row count too (H200, 2026-11-30, GPU ms at linear-CE's chunk shapes): 2048×128256
    # 0.359 → 0.337, 1024×128256 0.186 → 0.176, and on split rows 2048×256000 0.991 → 0.694 (Gemma-2B's linear-CE
    # chunks), 1024×256000 0.508 → 0.358.
    lane_sums: bool = True
    lane_sums_min_rows: int = 0
    # ptxas's register cap per thread for the lane-sum body (maxnreg; None = its choice), on rows up to
    # max_registers_cols wide: at 16384/32 it compiles to 57 registers (one 1024-thread program per SM) and to 32 with
    # no spill under a cap of 32 (two per SM; sass_report.py). H200, 2026-11-30: 8192×128256 1.282/1.301 →
    # 1.251/1.254 ms (random/peaked), 32768×128256 5.06 → 4.83, 16384×152064 2.960 → 2.953, but 4096×256000 1.370 →
    # 1.393 (two 512 KB rows per SM crowd L2 between the passes): capped on rows of up to 128K columns only.
    max_registers: int | None = 32
    max_registers_cols: int = 131072
    # Share of L2 that pass 1 plans for with evict_last (0 = every pass-1 load evict_last); see _keep_from. 0.6 took
    # 4096×256000 from 1.390 to 1.371 ms and left 128K-wide rows (whose tail is all but one block) alike; 0.4 lost at
    # 8192×128256, 0.9 won less (H200, 2026-11-30).
    keep_l2_share: float = 0.6
    # Rows wider than split_min_cols are split over 2, 4, ... programs of at most split_cols columns that meet
    # once between the passes (_share_partials). H200, 2026-11-30: 4096×256000 1.366 → 1.337 ms over 2
    # programs, 1.321 over 4 (16384×256000 5.282 → 5.191, 5.160), but 16384×152064 2.952 → 3.059 over 2 and
    # 8192×128256 1.248 → 1.316 over 2: each program idles at the meeting until its partner is done with pass 1.
    split_min_cols: int = 196608
    split_cols: int | None = 65536  # None = never split
    # Split rows: each program loads pass 2's first block before the meeting, so that load's latency overlaps the wait.
    # H200, 2026-11-30: 4096×256000 1.308 → 1.285 ms through the call (kernel 1.276), 32 registers.
    prefetch_pass2: bool = True


TUNING = CrossEntropyRowTuning()


@triton.jit
def _softcap(x, softcap):
    """(softcap·tanh(x/softcap), 1 − tanh²) in fp32 from one exp of a non-positive argument (no overflow)."""
    a = tl.abs(x) / softcap
    u = tl.exp(-2.0 * a)
    # (1−u)/(1+u) loses relative precision for small a: use tanh's Taylor series there (error < 1e-9 at a=0.1).
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.1, small, (1.0 - u) / (1.0 + u))
    t = tl.where(x < 0, -t, t)
    return softcap * t, 4.0 * u / ((1.0 + u) * (1.0 + u))


@triton.jit
def _log1p(v):
    """log(1 + v) accurate for tiny v (Goldberg's trick; the interpreter has no libdevice)."""
    w = 1.0 + v
    d = w - 1.0
    return tl.where(d == 0.0, v, tl.log(w) * (v / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _stats_block(x, w, m, s, sum_x, rank, x_t, t_off, offs, mask, softcap,
                 MASKED: tl.constexpr, TARGET: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                 WITH_RANK: tl.constexpr, CLASS_WEIGHTED: tl.constexpr):
    """Pass 1 over one block: fold fp32 logits x (lanes × columns) into per-lane running maxima m and sums
    s = Σ_{j≠t} e^{x_j − m}, Σx (Σ w_j·x_j when CLASS_WEIGHTED, w the block's class weights) and the target's
    rank #{j: x_j > x_t, or x_j = x_t and j < t} (argmax's rule: the first of tied logits wins), all reduced along
    axis 1 only. A lane is one thread's 16 bytes, so the loop needs no shuffle and no barrier (see LANE in
    _ce_kernel). Per-element work only where needed: the mask in the MASKED (last, partial) block, the target's
    exclusion (column t_off of offs) in a TARGET block."""
    if HAS_SOFTCAP:
        x = _softcap(x, softcap)[0]
    if HAS_SMOOTHING and CLASS_WEIGHTED:  # before the mask's −inf, which times a weight of 0 would be NaN
        sum_x += tl.sum(tl.where(mask, x * w, 0.0) if MASKED else x * w, 1)
    if MASKED:
        x = tl.where(mask, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    e = _exp(x - m_new[:, None])
    if TARGET:
        e = tl.where(offs == t_off, 0.0, e)
    s = s * _exp(m - m_new) + tl.sum(e, 1)
    if HAS_SMOOTHING and not CLASS_WEIGHTED:
        sum_x += tl.sum(tl.where(mask, x, 0.0) if MASKED else x, 1)
    if WITH_RANK:  # above the target, or tied with it at a lower column (t_off: the target's column - the block's)
        rank += tl.sum(((x > x_t) | ((x == x_t) & (offs < t_off))).to(tl.int32), 1)
    return m_new, s, sum_x, rank


@triton.jit
def _merge_lanes(m, s, sum_x, rank):
    """The row's (max, Σ e^{x−max}, Σx, rank) from per-lane partials: one cross-thread reduction per row."""
    m_row = tl.max(m, 0)
    return m_row, tl.sum(s * _exp(m - m_row), 0), tl.sum(sum_x, 0), tl.sum(rank, 0)


@triton.jit
def _grad_values(x, w, offs, lse, coef, shift, t_coef, t_add, t_off, softcap, TARGET: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, CLASS_WEIGHTED: tl.constexpr):
    """g_j = coef·p_j − shift (shift·w_j when CLASS_WEIGHTED, w the columns' class weights) for fp32 logits x at
    columns offs, the target's entry t_coef·p_t + t_add (column t_off when TARGET; offs/t_off relative to the same
    origin)."""
    if HAS_SOFTCAP:
        x, dcap = _softcap(x, softcap)
    p = _exp(x - lse)
    g = p * coef - (shift * w if CLASS_WEIGHTED else shift)
    if TARGET:
        g = tl.where(offs == t_off, p * t_coef + t_add, g)
    if HAS_SOFTCAP:
        g = g * dcap
    return g


@triton.jit
def _grad_block(X, G, CW, start, offs, lse, coef, shift, t_coef, t_add, t_off, softcap, N_COLS: tl.constexpr,
                MASKED: tl.constexpr, TARGET: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EVICT: tl.constexpr,
                CLASS_WEIGHTED: tl.constexpr):
    """Pass 2 over one block of the row: load, _grad_values, store (t_off relative to the block)."""
    cols = start + offs
    w = 1.0
    if MASKED:
        mask = cols < N_COLS
        x = tl.load(X + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        if CLASS_WEIGHTED:
            w = tl.load(CW + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = None
        x = tl.load(X + cols, eviction_policy=EVICT).to(tl.float32)
        if CLASS_WEIGHTED:
            w = tl.load(CW + cols).to(tl.float32)
    g = _grad_values(x, w, offs, lse, coef, shift, t_coef, t_add, t_off, softcap, TARGET, HAS_SOFTCAP,
                     CLASS_WEIGHTED)
    tl.store(G + cols, g.to(G.dtype.element_ty), mask=mask, eviction_policy=EVICT)


@triton.jit
def _row_stats(X, CW, seg_start, seg_end, last, t_start, target, x_t, lanes, softcap, N_COLS: tl.constexpr,
               SEGMENT: tl.constexpr, WITH_RANK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_SMOOTHING: tl.constexpr, LANES: tl.constexpr, BLOCK_V: tl.constexpr, EVICT_PASS1: tl.constexpr,
               KEEP_FROM: tl.constexpr, EVICT_HEAD: tl.constexpr, CLASS_WEIGHTED: tl.constexpr):
    """Pass 1 over the whole blocks [seg_start, seg_end) of the row (and its partial last block when `last`):
    the merged (max, Σ_{j≠t} e^{x−max}, Σx, the target's rank), the running max started at x_t."""
    FULL: tl.constexpr = (N_COLS // BLOCK_V) * BLOCK_V  # columns in whole blocks: no mask there
    # Per-lane partials (LANES of them), merged once after the loops.
    m = tl.zeros([LANES], tl.float32) + x_t
    s = tl.zeros([LANES], tl.float32)
    sum_x = tl.zeros([LANES], tl.float32)
    rank = tl.zeros([LANES], tl.int32)
    # Whole blocks but the target's, then the target's (if whole), then the partial last block. A branch around a
    # whole block stays a branch; a per-element test would be if-converted into every block. (The loads stay here:
    # moved into _stats_block, as _grad_block does, ptxas gave the kernel 64 registers instead of 32 at 16384/32,
    # one program per SM instead of two; sass_report.py.)
    # w: the block's class weights (CLASS_WEIGHTED smoothing), defined in each block's branch: a value defined
    # before a runtime branch must keep its type there, and a block of weights is not a scalar.
    for b in range(0, KEEP_FROM, BLOCK_V):  # the segment's head: pass 2 comes back to it last (below)
        start = seg_start + b
        if (start != t_start) & (start < seg_end):
            x = tl.load(X + start + lanes, eviction_policy=EVICT_HEAD).to(tl.float32)
            if CLASS_WEIGHTED:
                w = tl.load(CW + start + lanes).to(tl.float32)
            else:
                w = 1.0
            m, s, sum_x, rank = _stats_block(x, w, m, s, sum_x, rank, x_t, target - start, lanes, None, softcap,
                                             False, False, HAS_SOFTCAP, HAS_SMOOTHING, WITH_RANK, CLASS_WEIGHTED)
    for b in range(KEEP_FROM, SEGMENT, BLOCK_V):
        start = seg_start + b
        if (start != t_start) & (start < seg_end):
            x = tl.load(X + start + lanes, eviction_policy=EVICT_PASS1).to(tl.float32)
            if CLASS_WEIGHTED:
                w = tl.load(CW + start + lanes).to(tl.float32)
            else:
                w = 1.0
            m, s, sum_x, rank = _stats_block(x, w, m, s, sum_x, rank, x_t, target - start, lanes, None, softcap,
                                             False, False, HAS_SOFTCAP, HAS_SMOOTHING, WITH_RANK, CLASS_WEIGHTED)
    if (t_start >= seg_start) & (t_start < seg_end):
        x = tl.load(X + t_start + lanes, eviction_policy=EVICT_PASS1).to(tl.float32)
        if CLASS_WEIGHTED:
            w = tl.load(CW + t_start + lanes).to(tl.float32)
        else:
            w = 1.0
        m, s, sum_x, rank = _stats_block(x, w, m, s, sum_x, rank, x_t, target - t_start, lanes, None, softcap,
                                         False, True, HAS_SOFTCAP, HAS_SMOOTHING, WITH_RANK, CLASS_WEIGHTED)
    if FULL < N_COLS:
        if last:
            mask = FULL + lanes < N_COLS
            x = tl.load(X + FULL + lanes, mask=mask, other=0.0, eviction_policy=EVICT_PASS1).to(tl.float32)
            if CLASS_WEIGHTED:
                w = tl.load(CW + FULL + lanes, mask=mask, other=0.0).to(tl.float32)
            else:
                w = 1.0
            m, s, sum_x, rank = _stats_block(x, w, m, s, sum_x, rank, x_t, target - FULL, lanes, mask, softcap,
                                             True, True, HAS_SOFTCAP, HAS_SMOOTHING, WITH_RANK, CLASS_WEIGHTED)
    return _merge_lanes(m, s, sum_x, rank)


@triton.jit
def _row_grad(X, G, CW, seg_start, seg_end, last, t_start, target, offs, lse, coef, shift, t_coef, t_add, softcap,
              x_first, N_COLS: tl.constexpr, SEGMENT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
              REVERSE: tl.constexpr, EVICT_PASS2: tl.constexpr, PREFETCHED: tl.constexpr,
              CLASS_WEIGHTED: tl.constexpr):
    """Pass 2 over the same columns as _row_stats: write the gradient. PREFETCHED: x_first holds the raw values of
    the segment's last whole block, loaded before the meeting; that block is written first, and skipped below."""
    FULL: tl.constexpr = (N_COLS // BLOCK_V) * BLOCK_V
    first = seg_end - BLOCK_V
    if PREFETCHED:
        x = x_first.to(tl.float32)
        w = 1.0
        if CLASS_WEIGHTED:
            w = tl.load(CW + first + offs).to(tl.float32)
        if first == t_start:
            g = _grad_values(x, w, offs, lse, coef, shift, t_coef, t_add, target - first, softcap, True, HAS_SOFTCAP,
                             CLASS_WEIGHTED)
        else:
            g = _grad_values(x, w, offs, lse, coef, shift, t_coef, t_add, 0, softcap, False, HAS_SOFTCAP,
                             CLASS_WEIGHTED)
        tl.store(G + first + offs, g.to(G.dtype.element_ty), eviction_policy=EVICT_PASS2)
    else:
        first = -1  # nothing skipped
    if REVERSE and FULL < N_COLS:  # the blocks pass 1 read last first: they are the likeliest in L2
        if last:
            _grad_block(X, G, CW, FULL, offs, lse, coef, shift, t_coef, t_add, target - FULL, softcap, N_COLS,
                        True, True, HAS_SOFTCAP, EVICT_PASS2, CLASS_WEIGHTED)
    for b in range(0, SEGMENT, BLOCK_V):
        start = seg_start + ((SEGMENT - BLOCK_V - b) if REVERSE else b)
        if (start != t_start) & (start < seg_end) & (start != first):
            _grad_block(X, G, CW, start, offs, lse, coef, shift, t_coef, t_add, 0, softcap, N_COLS,
                        False, False, HAS_SOFTCAP, EVICT_PASS2, CLASS_WEIGHTED)
    if (t_start >= seg_start) & (t_start < seg_end) & (t_start != first):
        _grad_block(X, G, CW, t_start, offs, lse, coef, shift, t_coef, t_add, target - t_start, softcap, N_COLS,
                    False, True, HAS_SOFTCAP, EVICT_PASS2, CLASS_WEIGHTED)
    if not REVERSE and FULL < N_COLS:
        if last:
            _grad_block(X, G, CW, FULL, offs, lse, coef, shift, t_coef, t_add, target - FULL, softcap, N_COLS,
                        True, True, HAS_SOFTCAP, EVICT_PASS2, CLASS_WEIGHTED)


@triton.jit
def _ce_kernel(
    LOGITS, GRAD, LABELS, LABEL_FLAG, LOSS, LSE, Q, RANK, SCALE, PARTIAL, COUNTERS, CW, W_SUM,
    stride_logits_row, stride_grad_row, stride_scale,
    ignore_index, label_smoothing, z_loss, softcap,
    N_COLS: tl.constexpr, FORWARD: tl.constexpr, BACKWARD: tl.constexpr, WITH_RANK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr, LANE: tl.constexpr,
    REVERSE: tl.constexpr, EVICT_PASS1: tl.constexpr, EVICT_PASS2: tl.constexpr, KEEP_FROM: tl.constexpr,
    EVICT_HEAD: tl.constexpr, SPLIT: tl.constexpr, SEGMENT: tl.constexpr, PHASE: tl.constexpr,
    PREFETCH_PASS2: tl.constexpr, CLASS_WEIGHTED: tl.constexpr,
):
    # SPLIT programs per row, each on SEGMENT columns of whole blocks (the last one also on the partial last block).
    # COUNTERS: one zeroed int32 meeting counter per row (SPLIT > 1 on the GPU; _ce_meet.meeting_counters).
    FULL: tl.constexpr = (N_COLS // BLOCK_V) * BLOCK_V
    PREFETCH: tl.constexpr = PREFETCH_PASS2 and SPLIT > 1 and FORWARD and BACKWARD and PHASE != 1
    if SPLIT == 1:
        row = tl.program_id(0).to(tl.int64)
        part = 0
        seg_start = 0
        seg_end = FULL
        last = True
    else:
        pid = tl.program_id(0)
        row = (pid // SPLIT).to(tl.int64)
        part = pid % SPLIT
        seg_start = part * SEGMENT
        seg_end = tl.minimum(seg_start + SEGMENT, FULL)
        last = part == SPLIT - 1
    X = LOGITS + row * stride_logits_row
    G = GRAD + row * stride_grad_row
    label = tl.load(LABELS + row).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    # Pass 1 sees a block as LANES × LANE: with LANE = one thread's vector load (16 bytes) each lane lives in one
    # thread and the loop reduces nothing across threads; LANE = BLOCK_V is one lane (a block-wide reduction, with
    # barriers, per block).
    LANES: tl.constexpr = BLOCK_V // LANE
    lanes = tl.arange(0, LANES)[:, None] * LANE + tl.arange(0, LANE)[None, :]
    clean = tl.load(LABEL_FLAG) == 0  # no bad label in the batch (_labels.LabelCheck): only then touch anything
    if clean & (label != ignore_index):
        target = label.to(tl.int32)  # < V once range-checked; int32 keeps the per-block offsets cheap
        t_start = (target // BLOCK_V) * BLOCK_V  # the target's block
        x_first = 0.0
        if FORWARD:
            x_t = 0.0
            if PHASE != 2:
                x_t = tl.load(X + target).to(tl.float32)  # labels were range-checked on the host
                if HAS_SOFTCAP:
                    x_t = _softcap(x_t, softcap)[0]
            m = x_t
            s = 0.0
            sum_x = 0.0
            rank = 0
            if PHASE != 2:
                m, s, sum_x, rank = _row_stats(X, CW, seg_start, seg_end, last, t_start, target, x_t, lanes,
                                               softcap, N_COLS, SEGMENT, WITH_RANK, HAS_SOFTCAP, HAS_SMOOTHING,
                                               LANES, BLOCK_V, EVICT_PASS1, KEEP_FROM, EVICT_HEAD, CLASS_WEIGHTED)
            if PREFETCH:  # pass 2's first block, loaded now: its latency overlaps the meeting's
                x_first = tl.load(X + seg_end - BLOCK_V + offs, eviction_policy=EVICT_PASS2)
            if SPLIT > 1:
                m, s, sum_x, rank, x_t = _share_partials(PARTIAL + row * (8 * SPLIT), COUNTERS + row, part, m, s,
                                                         sum_x, rank, x_t, SPLIT, PHASE)
            e_t = _exp(x_t - m)
            log_s = _log1p(s + (e_t - 1.0))  # S = S' + e_t >= 1 because the max term is e^0
            lse = m + log_s
            q = s / (s + e_t)
            if PHASE != 1:
                if part == 0:  # one program per row stores the row's results
                    loss = (1.0 - label_smoothing) * (log_s + (m - x_t))
                    if CLASS_WEIGHTED:  # w_t·((1−ε)·nll + z·lse²) + ε/V·Σ_j w_j·(lse − x_j)
                        w_t = tl.load(CW + target).to(tl.float32)
                        loss = w_t * (loss + z_loss * lse * lse)
                        loss += (label_smoothing / N_COLS) * (tl.load(W_SUM) * lse - sum_x)
                    else:
                        if HAS_SMOOTHING:
                            loss += label_smoothing * (lse - sum_x / N_COLS)
                        loss += z_loss * lse * lse
                    tl.store(LOSS + row, loss)
                    tl.store(LSE + row, lse)
                    tl.store(Q + row, q)
                    if WITH_RANK:
                        tl.store(RANK + row, rank)
        else:
            lse = tl.load(LSE + row)
            q = tl.load(Q + row)
        if BACKWARD and PHASE != 1:
            # g_j = scale·(p_j·(1 + zc) − ε/V), the target's entry scale·(p_t·zc − q + ε − ε/V), zc = 2z·lse.
            scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
            zc = 2.0 * z_loss * lse
            shift = scale * (label_smoothing / N_COLS)
            if CLASS_WEIGHTED:
                # g_j = scale·(p_j·(w_t·(1 − ε + zc) + ε·W/V) − ε/V·w_j), W = Σ_j w_j; the target's entry
                # scale·(p_t·(w_t·zc + ε·W/V) − w_t·(1 − ε)·q − ε/V·w_t) (the column shift is per column)
                w_t = tl.load(CW + target).to(tl.float32)
                spread = label_smoothing / N_COLS * tl.load(W_SUM)
                coef = scale * (w_t * (1.0 - label_smoothing + zc) + spread)
                t_coef = scale * (w_t * zc + spread)
                t_add = -scale * w_t * (1.0 - label_smoothing) * q - shift * w_t
            else:
                coef = scale * (1.0 + zc)
                t_coef = scale * zc
                t_add = scale * (label_smoothing - q) - shift
            _row_grad(X, G, CW, seg_start, seg_end, last, t_start, target, offs, lse, coef, shift, t_coef, t_add,
                      softcap, x_first, N_COLS, SEGMENT, HAS_SOFTCAP, BLOCK_V, REVERSE, EVICT_PASS2, PREFETCH,
                      CLASS_WEIGHTED)
    elif clean:
        if FORWARD and PHASE != 1:
            if part == 0:
                tl.store(LOSS + row, 0.0)
                tl.store(LSE + row, 0.0)
                tl.store(Q + row, 0.0)
                if WITH_RANK:
                    tl.store(RANK + row, -1)
        if BACKWARD and PHASE != 1:
            zeros = tl.zeros([BLOCK_V], dtype=GRAD.dtype.element_ty)
            seg_stop = N_COLS  # the last segment runs to the end of the row
            if SPLIT > 1:
                seg_stop = tl.where(last, N_COLS, seg_end)
            for b in range(0, SEGMENT + BLOCK_V, BLOCK_V):
                cols = seg_start + b + offs
                tl.store(G + cols, zeros, mask=cols < seg_stop, eviction_policy="evict_first")


def ce_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    grad: torch.Tensor | None,
    loss: torch.Tensor | None,
    lse: torch.Tensor,
    q: torch.Tensor,
    rank: torch.Tensor | None,
    scale: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    label_flag: torch.Tensor,
    class_smoothing: torch.Tensor | None = None,
) -> None:
    """Launch the row kernel on logits (rows, V) with unit column stride; label_flag is a _labels.LabelCheck's flag
    (the kernel writes nothing when it is set). class_smoothing: the (V,) class weights w when they come with label
    smoothing, which weighs every class (torch's F.cross_entropy(weight=w, label_smoothing=ε)); each row's loss is
    then w_t·((1−ε)·nll + z·lse²) + ε/V·Σ_j w_j·(lse − x_j), its class weight included, and its gradient to match.

    loss given → FORWARD (writes loss, lse, q, and rank if given); grad given → BACKWARD (writes grad, which may be
    logits itself, scaled by `scale`: a 0-dim or (rows,) fp32 tensor). Without loss, lse and q are inputs.
    """
    rows, n_cols = logits.shape
    if rows == 0:
        return
    assert logits.stride(1) == 1 and (grad is None or grad.stride(1) == 1)
    forward, backward = loss is not None, grad is not None
    block = min(TUNING.block_v, pow2(n_cols))
    lanes = TUNING.lane_sums and rows >= TUNING.lane_sums_min_rows
    split, segment = _split(n_cols, block)
    cap = _register_cap(lanes, segment)
    dummy = lse  # stands in for pointers a mode does not touch
    partial, counters = dummy, label_flag
    phases = (0,)
    if split > 1 and forward:  # the programs of a row meet between the passes (_share_partials)
        partial = torch.empty(rows * split * 8, dtype=torch.float32, device=logits.device)
        if runs_compiled(_ce_kernel):
            counters = meeting_counters(logits.device, rows)
        else:  # the interpreter runs programs one by one: publish in one launch, merge in the next
            phases = (1, 2)
    weighted = class_smoothing is not None and label_smoothing > 0
    if weighted:
        class_smoothing = class_smoothing.contiguous()
        w_sum = class_smoothing.float().sum()  # on the device: no host sync
    args = [logits, grad if backward else logits, labels, label_flag, loss if forward else dummy, lse, q,
            rank if rank is not None else dummy, scale if backward else dummy, partial, counters,
            class_smoothing if weighted else dummy, w_sum if weighted else dummy,
            logits.stride(0), grad.stride(0) if backward else 0, scale.stride(0) if backward and scale.dim() else 0,
            ignore_index, float(label_smoothing), float(z_loss), float(softcap or 1.0)]
    meta = dict(N_COLS=n_cols, FORWARD=forward, BACKWARD=backward, WITH_RANK=rank is not None,
                HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0, BLOCK_V=block,
                LANE=min(block, 16 // logits.element_size()) if lanes else block,
                REVERSE=TUNING.reverse_pass2,
                EVICT_PASS1="evict_last" if TUNING.eviction_hints else "",
                EVICT_PASS2="evict_first" if TUNING.eviction_hints else "",
                KEEP_FROM=_keep_from(logits, segment, block, lanes, cap),
                EVICT_HEAD="evict_first" if TUNING.eviction_hints else "",
                SPLIT=split, SEGMENT=segment, PHASE=0, PREFETCH_PASS2=TUNING.prefetch_pass2, CLASS_WEIGHTED=weighted,
                num_warps=max(1, min(TUNING.num_warps, block // 512)),
                **({} if cap is None else dict(maxnreg=cap)))
    for phase in phases:
        meta["PHASE"] = phase
        launch(_ce_kernel, (rows * split,), args, meta)


def _split(n_cols: int, block: int) -> tuple[int, int]:
    """(programs per row, whole-block columns per program): rows wider than TUNING.split_min_cols go to 2, 4, ...
    programs of at most TUNING.split_cols columns, so that a wide row puts no more in flight per SM than a narrower one.
    Every program gets at least one whole block: rounding the count up to a power of two (the meeting reduces over
    it) can leave the last programs none (V = 300000: 8 programs of 3 blocks of 16384 for 18 blocks), and such a
    program would start past the row's whole blocks: it missed zeroing an ignored row's tail, and with pass 2's
    prefetch it would load and write a neighbour's block. Then the count halves until none is empty."""
    whole = n_cols // block
    if not TUNING.split_cols or n_cols <= TUNING.split_min_cols:
        return 1, whole * block
    split = max(1, min(pow2(cdiv(n_cols, TUNING.split_cols)), pow2(whole + 1) // 2))
    while split > 1 and (split - 1) * cdiv(whole, split) >= whole:
        split //= 2
    return split, cdiv(whole, split) * block


def _register_cap(lanes: bool, n_cols: int) -> int | None:
    """maxnreg for the row kernel: TUNING.max_registers on the lane-sum body of rows up to TUNING.max_registers_cols
    wide (the per-block body is at 32 registers already)."""
    return TUNING.max_registers if lanes and n_cols <= TUNING.max_registers_cols else None


def _keep_from(logits: torch.Tensor, segment: int, block: int, lanes: bool, cap: int | None) -> int:
    """KEEP_FROM: pass 1 marks its loads evict_last only from this column of its segment on (a multiple of the
    block), and the segment's head before it evict_first. With TUNING.keep_l2_share, the tail kept is what one resident
    program may hold of that share of L2 (programs in flight at 32 warps: one per SM with lane sums at ptxas's 57
    registers, two at 32 registers — per-block sums, or lane sums under a register cap of 32); pass 2, in reverse,
    re-reads the tail first, and a head marked evict_last would only push other rows' tails out before they are
    re-read."""
    if not TUNING.keep_l2_share:
        return 0
    one_per_sm = lanes and (cap is None or cap > 32)
    in_flight = sm_count(logits.device) * (1 if one_per_sm else 2)
    keep = int(TUNING.keep_l2_share * _l2_bytes(logits.device)) // (in_flight * logits.element_size())
    return max(0, segment - keep // block * block)


@functools.lru_cache(maxsize=None)
def _l2_bytes(device: torch.device) -> int:
    """L2 size of a CUDA device (cached: a property lookup costs more than a launch); an H200's 50 MB elsewhere."""
    if device.type != "cuda":
        return 50 << 20
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
