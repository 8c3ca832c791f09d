"""Fused linear + cross-entropy: loss of (h·Wᵀ + b) against labels without ever holding the N×V logits.

Math: the cross_entropy options (ignore_index, label smoothing, z-loss, softcap, mean/sum/none, normaliser, class
weights, token scaling; see cross_entropy.py) on logits = h·Wᵀ + b (+ u·Bᵀ, the optional low-rank term), times
loss_scale. HF numerics: HF's lm_head gives bf16 logits (cuBLAS, fp32 accumulate, one rounding), then upcasts them
to fp32 for the loss; so does this op, chunk by chunk.
Gradients: with D = dlogits (scaled by loss_scale / denominator),  dh = D·W,  dW = Dᵀ·h,  db = Σ_rows D, and for
the low-rank term du = D·B,  dB = Dᵀ·u.

The low-rank term (``low_rank=(u, B)``, u (..., r), B (V, r)) is a LoRA adapter on the head: the caller computes
u = s·A·drop(h) with ordinary autograd (its gradient du reaches A and h through it), and the op adds u·Bᵀ to each
chunk's logits, so an adapted lm_head never forms the N×V logits either. Costs per chunk: one thin GEMM more in the
forward (M·V·r) and two in the gradients (du = D·B straight into the du slice, dB += Dᵀ·u into an fp32 V×r
accumulator); the extra memory is that accumulator and du (N×r).

Algorithm, per chunk of M token rows (all gradients are computed in the forward pass, so nothing N×V is saved):
  1. L = h_c·Wᵀ (+ b) (+ u_c·Bᵀ)           cuBLAS, bf16 out, into an M×V scratch (its argmax, when asked for)
  2. one Triton pass over L (_ce_core.py)   loss, lse, target rank, and D written over L (with token scaling two
                                            launches, the target probabilities p_t computed between them)
  3. dh_c = D·W (du_c = D·B)                cuBLAS, straight into the grad_hidden (grad_u) slice
  4. dW_acc += Dᵀ·h_c (dB_acc += Dᵀ·u_c)    cuBLAS with an fp32 C (addmm(out_dtype=float32), beta=1)
  5. db_acc += column sums of D (fp32)
  then grad_W = dW_acc cast to the weight dtype (or, TUNING.single_chunk_in_accumulator with N ≤ 2H, one chunk in a
  scratch the accumulator's size and step 4 as one GEMM straight into grad_W). Backward only multiplies the gradients
  by grad_output, with a kernel that reads grad_output on the device and does nothing when it is 1 (no host sync). A
  grad_output that is not a power of two rounds the bf16 gradients a second time (unbiased, ≤ 2⁻⁹ relative per
  element, never compounding across chunks or steps); a factor known up front belongs in loss_scale, which is folded
  in before the single rounding.

Counting (H200: ≈790 TFLOP/s dense bf16 peak, 655 measured on 8192³; 4.3 TB/s HBM; ridge ≈ 185 FLOP/B).
The three headline shapes (BT8192/H4096/V128256, BT8192/H2048/V256000, BT16384/H2048/V128256) all need
F = 6·N·H·V = 2.58e13 FLOP = 39.4 ms at 655 TFLOP/s. On top of the GEMMs:
  - step 2 moves 4–6 B per logit (read, L2-assisted re-read, write): N·V = 1.05e9 / 2.1e9 / 2.1e9
    → 1.0–1.5 / 2.0–3.0 / 2.0–3.0 ms.
  - step 4 reads and writes the fp32 accumulator: 8·V·H bytes per chunk. The dW GEMM of one chunk does
    2·M·V·H FLOP, so its intensity is M/4 FLOP/B. With a 256 MiB logits budget M = 256 MiB / (2V) = 524 rows
    at V=256K: intensity 131 < ridge, 4.2 GB of accumulator traffic (1.0 ms) against 0.84 ms of math, ×16 chunks
    → +3–5 ms. Rejected alternatives: a bf16 GEMM per chunk then an fp32 add (12·V·H B/chunk, worse, and one
    more V×H buffer); chunking the vocabulary (needs lse first: a 4th GEMM, +33% FLOP); accumulating pairs of
    chunks in bf16 (same traffic, bf16 rounding).
  - Chosen: the bf16 grad_W output (V×H, allocated anyway) is empty until the final cast, and its V·H elements
    hold exactly H rows of V logits. Using it as the scratch gives M = max(H, budget rows): 4096 / 2048 / 2048
    rows, intensity 512–1024 FLOP/B (compute-bound), 2 / 4 / 8 chunks, accumulator traffic 6 / 15 / 16 GB
    (1.5 / 3.4 / 3.7 ms) hidden under 13 ms of dW math, and no extra logits memory at all. Frozen W (no dW):
    the 256 MiB budget alone (no accumulator traffic to amortise). Final cast: 6·V·H B = 0.4–0.75 ms.
  Estimate: 39.4 + 1.5…3 (CE) + ≈1 (cast, imperfect overlap) ≈ 42–43.5 ms. Extra memory: the fp32 V×H
  accumulator (allowed) + O(N) fp32 row buffers + one fp32 V vector; the logits live in grad_W's storage.
Chunks run in the forward; reduction="none" is the exception: its per-token grad_output arrives in backward and
dW = Σ_i g_i·D_iᵀ·h_i cannot be rescaled afterwards, so the forward computes losses only and backward redoes the
chunks (4 GEMMs instead of 3).
Several heads over one hidden tensor: call once per head with shifted LABELS; hidden (B, T, H) is used as a
(B·T, H) view without a copy whenever its last dim is contiguous and the leading dims collapse.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._ce_core import ce_rows
from . import _grad_filter
from ._grad_filter import active_columns, sparse_gradients
from .._custom_ops import absent, custom_op, refuse_double_backward
from ._loss_common import (LossOutput, check_class_weights, check_options, class_weight_scales, predicted_tokens,
                           row_kernel_options, row_weights, scale_, scaled, scaled_sum, take_grads, token_accuracy,
                           token_scaled_rows, z_loss_term)
from .._dispatch import once_differentiable, row_view, use_triton
from ._labels import LabelCheck
from .._launch import on_input_device
from .cross_entropy import cross_entropy_reference, loss_extras_reference


@dataclass(frozen=True)
class LinearCrossEntropyTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    # Tunables: bytes of logits scratch when grad_W's storage is not available (frozen W or bf16 accumulation),
    # and whether grad_W's storage serves as the scratch when it holds at least as many rows.
    logits_budget_bytes: int = 256 << 20
    grad_weight_as_scratch: bool = True
    # Whether the scratch is split in two so that one chunk's CE pass (memory-bound Triton, a side CUDA stream) runs
    # while the previous chunk's gradient GEMMs (compute-bound cuBLAS) run: the pass costs 1-5 ms of the 40-45 ms op
    # at the headline shapes, serialised. Halved chunks keep M ≥ 1024 rows per GEMM but double the fp32 dW accumulator
    # passes; off until bench_fused_linear_cross_entropy's "overlap" variant says which wins.
    overlap_ce: bool = False
    # Whether N token rows whose logits fit in the bytes of the fp32 V×H accumulator (N ≤ 2H for bf16) run as one chunk
    # in a scratch of that size instead of the accumulator: dW is then one GEMM written straight into grad_W (cuBLAS
    # accumulates in fp32 and rounds once, as accumulator + final cast do), so the accumulator's read-modify-write
    # passes and the final cast (6·V·H bytes) disappear, at the same peak memory. Covers BT8192/H4096 and Medusa's
    # 8K-token heads at 8B width. Measured on the H200 (2026-11-29, BENCHMARKS.md): BT8192/H4096/V128256 40.17 →
    # 38.78 ms (random logits), Medusa 8K-token steps +3-5%, the 8B-width training step +2%, peak memory unchanged.
    single_chunk_in_accumulator: bool = True
    # A cap on the logits scratch in bytes (None: none; the fused_linear_cross_entropy argument max_scratch_bytes
    # overrides it per call). Below grad_W's size it also changes where dW is formed: with fp32 accumulation over
    # several chunks, the accumulator is two vocabulary halves whose first half's storage has exactly grad_W's bytes,
    # and dW is cast into that storage in place (_accumulator_becoming_grad), so the op's peak is the fp32 accumulator
    # + the cap instead of the accumulator + grad_W (4·V·H + cap bytes instead of 6·V·H for bf16). The price is more,
    # smaller chunks, each re-reading and re-writing the accumulator in two half-GEMMs. H200, 2026-11-30
    # (BENCHMARKS.md, "The logits-scratch cap"), Gemma-2B's loss (16384 × 2048 × 256000): 82.9 ms uncapped; a 1536-row
    # cap (750 MiB) 88.5 ms and 0.24 GiB less, 1024 rows 91.5 ms and 0.49 GiB less; its whole step 37.2k → 36.8k tok/s
    # at 40.0 → 39.7 GiB peak: a knob for fitting a batch, not a default.
    max_scratch_bytes: int | None = None
    # The gradient filter's threshold when a call passes none (None: exact gradients; `--loss-grad-filter-eps` sets it
    # for a training run). See _grad_filter.py.
    grad_filter_eps: float | None = None


TUNING = LinearCrossEntropyTuning()


def target_rank_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                          softcap: float | None = None) -> torch.Tensor:
    """int32 ranks of labels' shape: entries with a logit above the target's, or equal to it at a lower index
    (argmax's rule: of tied logits the first wins, so all-equal logits rank only column 0 first); -1 where
    ignored."""
    x = logits.reshape(-1, logits.shape[-1]).float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    flat = labels.reshape(-1)
    valid = flat != ignore_index
    index = torch.where(valid, flat, 0)[:, None]
    target = x.gather(-1, index)
    before = torch.arange(x.shape[-1], device=x.device) < index
    rank = ((x > target) | ((x == target) & before)).sum(-1).to(torch.int32)
    return torch.where(valid, rank, torch.full_like(rank, -1)).reshape(labels.shape)


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
    loss_scale: float = 1.0,
    accum_dtype: torch.dtype = torch.float32,
    return_target_rank: bool = False,
    grad_filter_eps: float | None = None,
    class_weights: torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_token_scaling: bool = False,
    return_predicted_tokens: bool = False,
):
    """Eager PyTorch: logits = F.linear(h, W, b) in the input dtype (as HF's lm_head), with low_rank=(u, B) plus
    u·Bᵀ added by torch.addmm (the sum rounded once to the input dtype, as the op's chunks round it), then fp32
    cross-entropy.

    Same signature as `fused_linear_cross_entropy`; accum_dtype has no effect here (autograd's dW is one GEMM);
    grad_filter_eps filters with all tokens as one chunk.
    """
    logits = F.linear(hidden, weight, bias)
    if low_rank is not None:
        u, lw = low_rank
        flat = torch.addmm(logits.reshape(-1, weight.shape[0]), u.reshape(-1, u.shape[-1]), lw.t())
        logits = flat.view(logits.shape)
    if grad_filter_eps is not None and logits.requires_grad:
        # the kernel's per-token gradient: class-weighted only where it weighs its rows itself (with smoothing)
        kept = _kept_columns(logits.detach(), labels, grad_filter_eps, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                             class_weights=class_weights if label_smoothing else None)
        logits.register_hook(lambda grad: grad * kept.to(grad.dtype))
    loss = cross_entropy_reference(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, reduction=reduction, normalizer=normalizer, class_weights=class_weights,
        use_token_scaling=use_token_scaling,
    ) * loss_scale
    if return_z_loss or return_token_accuracy or return_predicted_tokens:
        z, accuracy, predicted = loss_extras_reference(
            logits, labels, ignore_index=ignore_index, z_loss=z_loss, softcap=softcap, reduction=reduction,
            normalizer=normalizer, loss_scale=loss_scale, class_weights=class_weights,
            use_token_scaling=use_token_scaling, want_z=return_z_loss, want_accuracy=return_token_accuracy,
            want_predicted=return_predicted_tokens)
        rank = target_rank_reference(logits.detach(), labels, ignore_index, softcap) if return_target_rank else None
        return LossOutput(loss, z, accuracy, rank, predicted)
    if not return_target_rank:
        return loss
    with torch.no_grad():
        return loss, target_rank_reference(logits, labels, ignore_index, softcap)


def _kept_columns(logits: torch.Tensor, labels: torch.Tensor, eps: float, **opts) -> torch.Tensor:
    """(V,) bool: the columns that some token's own loss gradient ∂ℓ_t/∂z_tj reaches eps in (grad_filter_eps's
    rule, _grad_filter.py, with every token in one chunk)."""
    with torch.enable_grad():
        z = logits.reshape(-1, logits.shape[-1]).requires_grad_()
        per_token = cross_entropy_reference(z, labels.reshape(-1), reduction="none", **opts)
        (grad,) = torch.autograd.grad(per_token.sum(), z)
    return ((grad.abs() >= eps) & (grad != 0)).any(0)


@functools.lru_cache(maxsize=None)
def _fp32_out_gemm(device: torch.device) -> bool:
    """Whether torch.addmm(C_fp32, A_bf16, B_bf16, out_dtype=float32, out=C) works here (torch ≥ 2.8 on CUDA)."""
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        c = torch.full((16, 16), float("nan"), dtype=torch.float32, device=device)
        torch.addmm(c, a.t(), a, out_dtype=torch.float32, beta=0.0, out=c)  # beta=0 must ignore the NaNs
        torch.addmm(c, a.t(), a, out_dtype=torch.float32, beta=1.0, out=c)
        return bool((c == 32).all())
    except (TypeError, RuntimeError, NotImplementedError):
        return False


@contextlib.contextmanager
def _fp32_split_k():
    """cuBLAS may otherwise sum split-K partials of a bf16 GEMM in bf16 (PyTorch's default allows it): a dW whose
    GEMM is its only accumulator (one chunk) must be summed in fp32 end to end."""
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = allowed


def _accumulate_dw(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc (V, H) = [acc +] dlogitsᵀ·h, reading and writing acc once (beta=0 on the first chunk: no zero-fill)."""
    beta = 0.0 if first else 1.0
    if acc.dtype == dlogits.dtype:
        with _fp32_split_k():
            torch.addmm(acc, dlogits.t(), h, beta=beta, out=acc)
    elif _fp32_out_gemm(acc.device):
        torch.addmm(acc, dlogits.t(), h, out_dtype=acc.dtype, beta=beta, out=acc)
    else:  # exact fallback (CPU, older torch): fp32 GEMMs over vocabulary slabs that fit the budget
        hf = h.to(acc.dtype)
        slab = max(1, TUNING.logits_budget_bytes // (4 * (dlogits.shape[0] + h.shape[1])))
        for v in range(0, acc.shape[0], slab):
            part = acc[v : v + slab]
            torch.addmm(part, dlogits[:, v : v + slab].t().to(acc.dtype), hf, beta=beta, out=part)


def _scratch(n: int, h: torch.Tensor, vocab: int, grad_w: torch.Tensor | None, use_grad_w: bool,
             cap_rows: int | None, cap_is_size: bool = False) -> tuple[list[torch.Tensor], int]:
    """The logits buffers of the chunk loop and the rows each holds: one buffer, or two halves when the CE pass
    is overlapped (TUNING.overlap_ce) and there is more than one chunk. Storage: grad_W's (H rows of V) when allowed and
    at least the budget (equal chunks without a second V·H-sized buffer: Mistral's V 32768 at H 4096 and a 256 MiB
    budget are exactly equal), else a new budget-sized tensor; never more than cap_rows rows. cap_is_size: the
    scratch is cap_rows rows even above the budget (the accumulator becoming grad_W: the cap is the bytes the
    caller gave the scratch; the budget's 524 rows at V 256000 would triple the chunks and their accumulator
    passes)."""
    budget_rows = max(1, TUNING.logits_budget_bytes // (vocab * h.element_size()))
    if cap_rows is not None:
        budget_rows = cap_rows if cap_is_size else min(budget_rows, cap_rows)
    storage = grad_w.view(-1) if use_grad_w and h.shape[1] >= budget_rows else None
    capacity = h.shape[1] if storage is not None else budget_rows
    count = 2 if TUNING.overlap_ce and n > capacity and capacity >= 2 else 1
    rows = min(n, capacity // count)
    if storage is None:
        storage = torch.empty(count * rows * vocab, dtype=h.dtype, device=h.device)
    return [storage[i * rows * vocab : (i + 1) * rows * vocab].view(rows, vocab) for i in range(count)], rows


def _accumulator_becoming_grad(vocab: int, hdim: int, dtype: torch.dtype,
                               device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """An fp32 (V, H) accumulator as two vocabulary halves [lo, hi], and grad_W (V, H) in `dtype` over lo's
    storage: lo has ceil(V·size/4) rows, so its bytes hold all of dW in `dtype`. grad_W is valid only after
    _cast_into_grad; until then its bytes are lo's accumulator. A tensor of its own over the storage (not a view of
    lo), so that autograd can keep it as .grad once lo is gone."""
    lo_rows = -(-vocab * torch.finfo(dtype).bits // 32)
    lo = torch.empty(lo_rows, hdim, dtype=torch.float32, device=device)
    hi = torch.empty(vocab - lo_rows, hdim, dtype=torch.float32, device=device)
    grad_w = torch.empty(0, dtype=dtype, device=device).set_(lo.untyped_storage(), 0, (vocab, hdim))
    return [lo, hi], grad_w


def _cast_into_grad(halves: list[torch.Tensor], grad_w: torch.Tensor, first: int = 1 << 20) -> None:
    """grad_W = [lo; hi] rounded to grad_W's dtype, written over lo's own storage.

    Element i of lo (fp32, bytes 4i..4i+4) goes to bytes 2i..2i+2 (for a 2-byte dtype). Copying elements [a, 2a)
    in one step reads bytes [4a, 8a) and writes [2a, 4a): disjoint, and what it overwrites (elements < a) was
    copied by an earlier step on the same stream. So after one small copy through a clone, doublings finish lo in
    log2(lo / first) launches; hi then lands in lo's already-copied upper part."""
    lo, hi = halves
    src, dst = lo.view(-1), grad_w.view(-1)
    done = min(first, src.numel())
    dst[:done].copy_(src[:done].clone())
    while done < src.numel():
        end = min(src.numel(), 2 * done)
        dst[done:end].copy_(src[done:end])
        done = end
    dst[src.numel():].copy_(hi.view(-1))


@functools.lru_cache(maxsize=None)
def _ce_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _run_chunks(h, weight, bias, labels, opts, *, lse, q, loss=None, rank=None, scale=None,
                need=(False,) * 5, accum_dtype=torch.float32, max_scratch_bytes=None, grad_filter_eps=None,
                low_rank=None, token_p=None, predicted=None):
    """The chunk loop of the module docstring; loss given → forward (writes loss, lse, q, rank), scale given →
    gradients (lse, q are inputs when loss is None). low_rank: (u (N, r), B (V, r)) or None. need: which of
    (h, W, b, u, B) get gradients. Returns (grad_h (N, H), grad_W, grad_b, grad_u (N, r), grad_B) or Nones.
    grad_filter_eps: each chunk's gradient GEMMs run over the columns that carry gradient (_grad_filter.py), or over
    all of them when too many do.
    token_p (N,) fp32, forward only: use_token_scaling; each row's target probability is written there and multiplies
    its gradient scale (token_scaled_rows; the losses stay unscaled). predicted (N,) int64: the predicted tokens.

    With two logits buffers, chunk i's CE pass is issued before chunk i−1's gradient GEMMs, which then read the
    other buffer; on CUDA the CE pass runs on a side stream, so it overlaps those GEMMs (events order each buffer's
    GEMM → CE → gradient GEMMs → next GEMM into it). On the CPU the same schedule runs in program order.
    """
    n, hdim = h.shape
    vocab = weight.shape[0]
    need_h, need_w, need_b, need_u, need_lw = need
    u, lw = low_rank if low_rank is not None else (None, None)
    backward = scale is not None
    grad_h = torch.empty(n, hdim, dtype=h.dtype, device=h.device) if need_h else None
    # du is written chunk by chunk; dB (V × r, small) always sums in fp32, whatever accum_dtype says for dW
    grad_u = torch.empty(n, u.shape[1], dtype=u.dtype, device=h.device) if need_u else None
    acc_lw = torch.zeros(vocab, lw.shape[1], dtype=torch.float32, device=h.device) if need_lw else None
    cap = TUNING.max_scratch_bytes if max_scratch_bytes is None else max_scratch_bytes
    cap_rows = None if cap is None else max(1, cap // (vocab * h.element_size()))
    one_chunk = (need_w and accum_dtype != weight.dtype and TUNING.single_chunk_in_accumulator
                 and n * h.element_size() <= hdim * torch.finfo(accum_dtype).bits // 8
                 and (cap_rows is None or n <= cap_rows))
    exact = accum_dtype == weight.dtype or one_chunk  # one GEMM's own fp32 accumulation is the accumulator
    # fp32 accumulation over chunks, under a cap too small for grad_W's storage as the scratch: the accumulator
    # becomes grad_W in place (TUNING.max_scratch_bytes)
    in_place = need_w and not exact and cap_rows is not None and cap_rows < hdim and weight.element_size() == 2
    acc_w = halves = None  # dW accumulates in acc_w, or in the two halves of an accumulator becoming grad_W
    if in_place:
        halves, grad_w = _accumulator_becoming_grad(vocab, hdim, weight.dtype, h.device)
    elif need_w:
        grad_w = torch.empty(vocab, hdim, dtype=weight.dtype, device=h.device)
        acc_w = grad_w if exact else torch.empty_like(grad_w, dtype=accum_dtype)
    else:
        grad_w = None
    acc_b = torch.zeros(vocab, dtype=torch.float32, device=h.device) if need_b else None
    if one_chunk:
        buffers, rows = [torch.empty(n, vocab, dtype=h.dtype, device=h.device)], n
    else:
        buffers, rows = _scratch(n, h, vocab, grad_w,
                                 TUNING.grad_weight_as_scratch and acc_w is not None and acc_w is not grad_w, cap_rows,
                                 cap_is_size=in_place)
    side = _ce_stream(h.device) if len(buffers) == 2 and h.is_cuda else None
    main = torch.cuda.current_stream(h.device) if side is not None else None
    filtered = backward and grad_filter_eps is not None
    dw_targets = halves or ([acc_w] if acc_w is not None else None)  # where a sparse chunk scatters its dW rows

    def chunk_scale(s: int, e: int) -> torch.Tensor | None:  # the gradient scale: one for all rows, or per row
        return scale if scale is None or scale.dim() == 0 else scale[s:e]

    def gradients(i: int, s: int, e: int, logits: torch.Tensor, row_scale: torch.Tensor) -> None:
        # dlogits of rows s:e are in logits, each row scaled by row_scale (0-dim or per row)
        first = i == 0  # the first chunk sets dW: a dense GEMM with beta 0, or zeros and then its kept rows
        if filtered:
            cols = active_columns(logits, row_scale, grad_filter_eps)
            if cols.numel() <= _grad_filter.TUNING.dense_share * vocab:
                if first and dw_targets is not None:
                    for target in dw_targets:
                        target.zero_()
                sparse_gradients(logits, cols, weight, h[s:e], grad_h[s:e] if need_h else None, dw_targets,
                                 acc_b, _accumulate_dw,
                                 None if u is None else (u[s:e], lw, grad_u[s:e] if need_u else None, acc_lw))
                return
        if need_h:
            torch.mm(logits, weight, out=grad_h[s:e])
        if need_u:
            torch.mm(logits, lw, out=grad_u[s:e])
        if need_lw:
            _accumulate_dw(acc_lw, logits, u[s:e], first=False)
        if acc_w is not None:
            _accumulate_dw(acc_w, logits, h[s:e], first=first)
        elif halves is not None:
            split = halves[0].shape[0]
            _accumulate_dw(halves[0], logits[:, :split], h[s:e], first=first)
            _accumulate_dw(halves[1], logits[:, split:], h[s:e], first=first)
        if need_b:
            acc_b.add_(logits.sum(0, dtype=torch.float32))

    def finish(chunk: tuple) -> None:  # (i, s, e, logits, row scale, event of its CE pass on the side stream or None)
        if chunk[5] is not None:
            main.wait_event(chunk[5])
        gradients(*chunk[:5])

    pending = None  # a chunk whose CE pass is issued and whose gradients are not
    for i, s in enumerate(range(0, n, rows)):
        e = min(n, s + rows)
        h_c, logits = h[s:e], buffers[i % len(buffers)][: e - s]
        if bias is None:
            torch.mm(h_c, weight.t(), out=logits)
        else:
            torch.addmm(bias, h_c, weight.t(), out=logits)
        if u is not None:
            # The adapter's product added by the GEMM itself (beta = 1, fp32 accumulation): h·Wᵀ (+ b) is rounded to
            # the logits' dtype once, then the sum once more. HF + PEFT round as often with fp32 adapters (the fp32
            # term promotes the sum, which is cast back once) and more with adapters in the activations' dtype (the
            # product, the scaling, the sum). One GEMM over [h | u]·[W | B]ᵀ would round once, but needs a V×(H + r)
            # copy of the weights per call.
            logits.addmm_(u[s:e], lw.t())
        if predicted is not None:
            # Before the CE pass writes the gradient over the logits: one more read of the chunk (memory-bound, on
            # the GEMM's stream), paid only when the predictions are asked for.
            predicted_tokens(logits, labels[s:e], opts["ignore_index"], opts["softcap"], out=predicted[s:e])
        if side is not None:
            side.wait_stream(main)
        row_scale = chunk_scale(s, e)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            passes = dict(grad=logits if backward else None, loss=None if loss is None else loss[s:e],
                          lse=lse[s:e], q=q[s:e], rank=None if rank is None else rank[s:e], scale=row_scale)
            if token_p is None:
                ce_rows(logits, labels[s:e], **passes, **opts)
            else:
                row_scale = token_scaled_rows(logits, labels[s:e], **passes, p=token_p[s:e], **opts)
                if side is not None and row_scale is not None:
                    row_scale.record_stream(main)  # made on the side stream, read by the filter pass on main
        chunk = (i, s, e, logits, row_scale, side.record_event() if side is not None else None)
        if len(buffers) == 1:
            finish(chunk)
            continue
        if pending is not None:  # the other buffer's chunk: its GEMMs now overlap this chunk's CE pass
            finish(pending)
        pending = chunk
    if pending is not None:
        finish(pending)
    if side is not None:
        main.wait_stream(side)  # nothing the side stream touched may be freed or read before its work is done
    if acc_w is not None and acc_w is not grad_w:
        grad_w.copy_(acc_w)
    elif halves is not None:
        _cast_into_grad(halves, grad_w)
    return (grad_h, grad_w, None if acc_b is None else acc_b.to(bias.dtype), grad_u,
            None if acc_lw is None else acc_lw.to(lw.dtype))


# id(weight) → (weak reference to it, consumer). Keyed by id: a WeakKeyDictionary would compare tensors with ==.
_GRAD_CONSUMERS: dict[int, tuple[weakref.ref, Callable[[torch.Tensor | None, object], None]]] = {}


def _consumer_of(weight: torch.Tensor):
    entry = _GRAD_CONSUMERS.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def consume_weight_grad(weight: torch.Tensor,
                        fn: Callable[[torch.Tensor | None, object], None]) -> Callable[[], None]:
    """Hand ``weight``'s gradient to ``fn`` inside the forward, the moment linear-CE has computed it, instead of
    returning it to autograd in backward. Returns a function that undoes this.

    Why: the gradients are computed in the forward (module docstring); returned through autograd, dW (V×H) stays
    alive until backward reaches the loss, so at the end of the forward it coexists with every activation, and
    with every other head's dW for Medusa (5 heads at Llama-3-8B width: 5 GiB). A consumer that applies it at once
    (an optimizer step, liger_models/train/step_in_backward.py) frees it there.
    Contract: (1) the weight gets its whole gradient from one such call per backward (not tied, not shared);
    (2) the loss reaches backward with gradient exactly 1 (``loss.backward()`` of a sum of such losses), checked
    in backward, which raises otherwise since the gradient was already spent; (3) reduction "mean" or "sum"
    ("none" learns its per-token gradient only in backward and returns dW as usual). The forward calls
    ``fn(dW, node)``; in backward, once the check passed, ``fn(None, node)`` says that this loss's backward ran.
    ``node`` is the loss's autograd node: weakly referenced, it tells a forward whose loss was dropped (dead) from
    one whose loss may still be backpropagated (alive).
    """
    key = id(weight)

    def forget(_ref=None) -> None:
        entry = _GRAD_CONSUMERS.get(key)
        if entry is not None and entry[1] is fn:
            del _GRAD_CONSUMERS[key]

    _GRAD_CONSUMERS[key] = (weakref.ref(weight, forget), fn)
    return forget


def _check_unit_gradient(grad_out: torch.Tensor) -> None:
    """The consumed dW assumed d(final)/d(loss) = 1: anything else would have needed a different dW (host read)."""
    if not bool((grad_out == 1).all()):
        raise RuntimeError(
            f"linear-CE handed its weight gradient to a consumer in the forward, assuming the loss is backpropagated "
            f"with gradient 1, but it got {grad_out.reshape(-1)[:1].item()}; scale the loss through loss_scale, "
            f"not afterwards, or do not register a consumer (consume_weight_grad)")


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts, reduction, loss_scale, accum_dtype, need, with_rank,
                labels_ok, max_scratch_bytes, grad_filter_eps, row_w, extras, u, lw, token_scaling):
        # row_w, with class weights (None: unweighted): for "none" each row's weight, for mean / sum each row's
        # d(loss)/d(loss_t) (weighted_scale). extras: (z-loss term wanted, token accuracy wanted, predicted tokens
        # wanted). u, lw: the low-rank term's u and B, or None. need: gradients wanted for (hidden, weight, bias, u,
        # B). Outputs: the loss, then the rank, z, accuracy and predicted tokens that were asked for.
        ctx.opts, ctx.loss_scale, ctx.accum_dtype, ctx.need = opts, loss_scale, accum_dtype, need
        ctx.hidden_shape, ctx.reduction, ctx.max_scratch_bytes = hidden.shape, reduction, max_scratch_bytes
        ctx.grad_filter_eps = grad_filter_eps
        ctx.u_shape = None if u is None else u.shape
        fw = _forward(hidden, weight, bias, labels, opts, reduction, loss_scale, accum_dtype, need, with_rank,
                      labels_ok, max_scratch_bytes, grad_filter_eps, row_w, extras, u, lw, token_scaling)
        ctx.row_w = fw.row_w
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, fw.flat, fw.lse, fw.q, u, lw)
        else:
            grads = fw.grads
            ctx.consumer = _consumer_of(weight) if need[1] else None
            if ctx.consumer is not None:  # hand dW over now, so it need not live until backward
                labels_ok.wait()  # never a dW from skipped CE passes (a bad label) into an optimizer step
                ctx.consumer(grads[1], ctx)
                grads = (grads[0], None, *grads[2:])
            ctx.grads = grads
        outputs = [t for t in (fw.out, fw.rank, fw.z, fw.accuracy, fw.predicted) if t is not None]
        if len(outputs) == 1:
            return fw.out
        ctx.mark_non_differentiable(*outputs[1:])
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_):
        if ctx.reduction == "none":
            hidden, weight, bias, flat, lse, q, u, lw = ctx.saved_tensors
            grads = _deferred_grads(grad_out, hidden, weight, bias, flat, lse, q, ctx.row_w, ctx.opts,
                                    ctx.loss_scale, ctx.need, ctx.accum_dtype, ctx.max_scratch_bytes,
                                    ctx.grad_filter_eps, None if u is None else (u, lw))
        else:
            if ctx.consumer is not None:
                _check_unit_gradient(grad_out)
                ctx.consumer(None, ctx)
            grads = take_grads(ctx)
            for g in grads:
                if g is not None:
                    scale_(g, grad_out)
        grad_h, grad_w, grad_b, grad_u, grad_lw = grads
        if grad_h is not None:
            grad_h = grad_h.view(ctx.hidden_shape)
        if grad_u is not None:
            grad_u = grad_u.view(ctx.u_shape)
        return grad_h, grad_w, grad_b, *[None] * 12, grad_u, grad_lw, None


class _Forward(NamedTuple):
    out: torch.Tensor  # the loss (0-dim, or per token in labels' shape)
    grads: tuple | None  # mean / sum: (grad_h (N, H), grad_W, grad_b, grad_u (N, r), grad_B), None if not needed
    flat: torch.Tensor
    lse: torch.Tensor
    q: torch.Tensor
    rank: torch.Tensor | None  # the outputs asked for: ranks in labels' shape, z-loss term, token accuracy,
    z: torch.Tensor | None  # predicted tokens in labels' shape
    accuracy: torch.Tensor | None
    predicted: torch.Tensor | None
    row_w: torch.Tensor | None  # "none"'s per-row weights of the deferred gradient: class weights × p_t, or None


def _forward(hidden, weight, bias, labels, opts, reduction, loss_scale, accum_dtype, need, with_rank, labels_ok,
             max_scratch_bytes, grad_filter_eps, row_w, extras, u=None, lw=None, token_scaling=False) -> _Forward:
    """The forward pass of the Function and of the custom op: losses, and for mean / sum all gradients."""
    h, flat = row_view(hidden), labels.reshape(-1)
    low_rank = None if u is None else (row_view(u), lw)
    loss = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    lse, q = torch.empty_like(loss), torch.empty_like(loss)
    want_z, want_accuracy, want_predicted = extras
    rank = (torch.empty(h.shape[0], dtype=torch.int32, device=h.device) if with_rank or want_accuracy
            else None)
    token_p = torch.empty_like(loss) if token_scaling else None
    predicted = torch.empty(h.shape[0], dtype=torch.int64, device=h.device) if want_predicted else None
    grads = None
    if reduction == "none":
        _run_chunks(h, weight, bias, flat, opts, lse=lse, q=q, loss=loss, rank=rank,
                    max_scratch_bytes=max_scratch_bytes, low_rank=low_rank, token_p=token_p, predicted=predicted)
        if token_p is not None:  # the deferred gradient's row weights carry p_t too
            row_w = token_p if row_w is None else row_w * token_p
        row_scale = loss_scale if row_w is None else row_w * loss_scale
        out = (loss * row_scale).reshape(labels.shape)
    else:
        # Per-token d(loss)/d(loss_t): LabelCheck's one scale, or one per row with class weights
        scale = labels_ok.scale if row_w is None else row_w
        grads = _run_chunks(h, weight, bias, flat, opts, lse=lse, q=q, loss=loss, rank=rank,
                            scale=scale if any(need) else None, need=need, accum_dtype=accum_dtype,
                            max_scratch_bytes=max_scratch_bytes, grad_filter_eps=grad_filter_eps, low_rank=low_rank,
                            token_p=token_p, predicted=predicted)
        if token_p is not None:
            scale = scale * token_p
        out = scaled_sum(loss, scale) if scale.dim() == 0 else (loss * scale).sum()
        row_scale = scale
    z = accuracy = None
    if want_z:
        if opts["class_smoothing"] is not None:  # the kernel weighed its rows: so is the z-loss term inside them
            row_scale = row_scale * row_weights(flat, opts["class_smoothing"], opts["ignore_index"])
        z = z_loss_term(lse, flat != opts["ignore_index"], opts["z_loss"], row_scale,
                        reduction if reduction == "none" else "sum", labels.shape)
    if want_accuracy:
        accuracy = token_accuracy(rank)
    return _Forward(out, grads, flat, lse, q, rank.reshape(labels.shape) if with_rank else None, z, accuracy,
                    None if predicted is None else predicted.reshape(labels.shape), row_w)


def _deferred_grads(grad_out, hidden, weight, bias, flat, lse, q, row_w, opts, loss_scale, need, accum_dtype,
                    max_scratch_bytes, grad_filter_eps, low_rank=None):
    """reduction="none"'s backward: the chunks again, with the per-token grad_output as the rows' scale."""
    scale = grad_out.reshape(-1).float() * loss_scale
    scale = (scale if row_w is None else scale * row_w).contiguous()
    if low_rank is not None:
        low_rank = (row_view(low_rank[0]), low_rank[1])
    return _run_chunks(row_view(hidden), weight, bias, flat, opts, lse=lse, q=q, scale=scale, need=need,
                       accum_dtype=accum_dtype, max_scratch_bytes=max_scratch_bytes, grad_filter_eps=grad_filter_eps,
                       low_rank=low_rank)


def _row_scales(labels, class_weights, ignore_index: int, reduction: str, normalizer, loss_scale: float,
                label_smoothing: float):
    """With class weights, each row's weight ("none"; None where the kernel weighs its rows itself, with label
    smoothing: _loss_common's class_weight_scales) or d(loss)/d(loss_t) (mean / sum); None without."""
    if class_weights is None:
        return None
    row_w, scale = class_weight_scales(labels, class_weights, ignore_index, reduction, normalizer, float(loss_scale),
                                       label_smoothing)
    return row_w if reduction == "none" else scale



# ---- the custom ops torch.compile traces (_custom_ops.py) ---------------------------------------------------------
# Options added later come last in the schemas, with defaults, so that earlier calls read as before: the low-rank
# term's arguments and gradients, then use_token_scaling and the predicted tokens.

@custom_op("fused_linear_cross_entropy")
def _fused_linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
    normalizer: Optional[torch.Tensor], class_weights: Optional[torch.Tensor], ignore_index: int,
    label_smoothing: float, z_loss: float, softcap: Optional[float], reduction: str, loss_scale: float,
    accum_dtype: torch.dtype, need_hidden: bool, need_weight: bool, need_bias: bool, with_rank: bool,
    max_scratch_bytes: Optional[int], grad_filter_eps: Optional[float], want_z: bool, want_accuracy: bool,
    low_rank_input: Optional[torch.Tensor] = None, low_rank_weight: Optional[torch.Tensor] = None,
    need_low_rank_input: bool = False, need_low_rank_weight: bool = False, use_token_scaling: bool = False,
    want_predicted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The triton path of `fused_linear_cross_entropy`, label check included: (loss, grad_h, grad_W, grad_b for
    mean / sum, lse, q, the label flag, row scales (for "none" with token scaling: the row weights times p_t),
    ranks, z-loss term, accuracy, grad_u, grad_B for mean / sum, predicted tokens), placeholders for what was not
    asked for. The check waits for its result here, at run time, as the eager call does."""
    return _traced_forward(hidden, weight, bias, labels, normalizer, class_weights, ignore_index, label_smoothing,
                           z_loss, softcap, reduction, loss_scale, accum_dtype,
                           (need_hidden, need_weight, need_bias, need_low_rank_input, need_low_rank_weight),
                           with_rank, max_scratch_bytes, grad_filter_eps, (want_z, want_accuracy, want_predicted),
                           low_rank_input, low_rank_weight, use_token_scaling)


@on_input_device  # launches, the check's event and its pinned copy all on the hidden states' device
def _traced_forward(hidden, weight, bias, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss,
                    softcap, reduction, loss_scale, accum_dtype, need, with_rank, max_scratch_bytes, grad_filter_eps,
                    extras, u, lw, token_scaling):
    labels = labels.contiguous()
    labels_ok = LabelCheck(labels, weight.shape[0], ignore_index, reduction, normalizer, loss_scale)
    opts = row_kernel_options(ignore_index, label_smoothing, z_loss, softcap, labels_ok.flag, class_weights)
    row_w = _row_scales(labels, class_weights, ignore_index, reduction, normalizer, loss_scale, label_smoothing)
    fw = _forward(hidden, weight, bias, labels, opts, reduction, loss_scale, accum_dtype, need, with_rank,
                  labels_ok, max_scratch_bytes, grad_filter_eps, row_w, extras, u, lw, token_scaling)
    labels_ok.wait()
    grad_h, grad_w, grad_b, grad_u, grad_lw = fw.grads or (None,) * 5
    grad_h = None if grad_h is None else grad_h.view(hidden.shape)
    grad_u = None if grad_u is None else grad_u.view(u.shape)

    def given(t):
        return absent(fw.lse) if t is None else t

    return (fw.out, *map(given, (grad_h, grad_w, grad_b)), fw.lse, fw.q, labels_ok.flag,
            *map(given, (fw.row_w, fw.rank, fw.z, fw.accuracy, grad_u, grad_lw, fw.predicted)))


@_fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss, softcap,
      reduction, loss_scale, accum_dtype, need_hidden, need_weight, need_bias, with_rank, max_scratch_bytes,
      grad_filter_eps, want_z, want_accuracy, low_rank_input=None, low_rank_weight=None, need_low_rank_input=False,
      need_low_rank_weight=False, use_token_scaling=False, want_predicted=False):
    f32 = dict(dtype=torch.float32, device=hidden.device)
    row = torch.empty(labels.numel(), **f32)
    loss_shape = labels.shape if reduction == "none" else ()
    fused = reduction != "none"

    def like(t, needed):
        return torch.empty(t.shape, dtype=t.dtype, device=t.device) if fused and needed else absent(row)

    return (torch.empty(loss_shape, **f32), like(hidden, need_hidden), like(weight, need_weight),
            like(bias, need_bias) if bias is not None else absent(row), row, torch.empty_like(row),
            torch.empty(2, dtype=torch.int64, device=hidden.device),
            torch.empty_like(row) if ((class_weights is not None and (fused or not label_smoothing))
                                      or (use_token_scaling and not fused)) else absent(row),
            torch.empty(labels.shape, dtype=torch.int32, device=hidden.device) if with_rank else absent(row),
            torch.empty(loss_shape, **f32) if want_z else absent(row),
            torch.empty((), **f32) if want_accuracy else absent(row),
            like(low_rank_input, need_low_rank_input) if low_rank_input is not None else absent(row),
            like(low_rank_weight, need_low_rank_weight) if low_rank_weight is not None else absent(row),
            torch.empty(labels.shape, dtype=torch.int64, device=hidden.device) if want_predicted else absent(row))


@custom_op("fused_linear_cross_entropy_backward")
def _fused_linear_cross_entropy_backward_op(
    grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    labels: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, label_flag: torch.Tensor, row_w: Optional[torch.Tensor],
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: Optional[float], loss_scale: float,
    accum_dtype: torch.dtype, need_hidden: bool, need_weight: bool, need_bias: bool,
    max_scratch_bytes: Optional[int], grad_filter_eps: Optional[float], low_rank_input: Optional[torch.Tensor],
    low_rank_weight: Optional[torch.Tensor], need_low_rank_input: bool, need_low_rank_weight: bool,
    class_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none"'s backward: (grad_h, grad_W, grad_b, grad_u, grad_B), placeholders for what was not asked
    for."""
    opts = row_kernel_options(ignore_index, label_smoothing, z_loss, softcap, label_flag, class_weights)
    low_rank = None if low_rank_input is None else (low_rank_input, low_rank_weight)
    need = (need_hidden, need_weight, need_bias, need_low_rank_input, need_low_rank_weight)
    grad_h, grad_w, grad_b, grad_u, grad_lw = _deferred_grads(
        grad_out, hidden, weight, bias, labels.contiguous().reshape(-1), lse, q, row_w, opts, loss_scale, need,
        accum_dtype, max_scratch_bytes, grad_filter_eps, low_rank)
    grad_h = None if grad_h is None else grad_h.view(hidden.shape)
    grad_u = None if grad_u is None else grad_u.view(low_rank_input.shape)
    return tuple(absent(lse) if g is None else g for g in (grad_h, grad_w, grad_b, grad_u, grad_lw))


@_fused_linear_cross_entropy_backward_op.register_fake
def _(grad_out, hidden, weight, bias, labels, lse, q, label_flag, row_w, ignore_index, label_smoothing, z_loss,
      softcap, loss_scale, accum_dtype, need_hidden, need_weight, need_bias, max_scratch_bytes, grad_filter_eps,
      low_rank_input, low_rank_weight, need_low_rank_input, need_low_rank_weight, class_weights=None):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) if t is not None and needed else absent(lse)
                 for t, needed in ((hidden, need_hidden), (weight, need_weight), (bias, need_bias),
                                   (low_rank_input, need_low_rank_input), (low_rank_weight, need_low_rank_weight)))


def _fused_linear_cross_entropy_setup(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, _, class_weights, *options, reduction, loss_scale, accum_dtype = inputs[:13]
    need, max_scratch_bytes, grad_filter_eps = inputs[13:16], inputs[17], inputs[18]
    u, lw, need_u, need_lw, token_scaling = inputs[21:26]  # defaults filled in when a call leaves them out
    _, grad_h, grad_w, grad_b, lse, q, flag, row_w, rank, z, accuracy, grad_u, grad_lw, predicted = output
    ctx.mark_non_differentiable(grad_h, grad_w, grad_b, lse, q, flag, row_w, rank, z, accuracy, grad_u, grad_lw,
                                predicted)
    ctx.reduction, ctx.need = reduction, (*need, need_u, need_lw)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, labels, lse, q, flag, row_w, u, lw, class_weights)
        ctx.weighted = (class_weights is not None and not options[1]) or token_scaling  # options[1]: smoothing
        ctx.options = (*options, loss_scale, accum_dtype, *need, max_scratch_bytes, grad_filter_eps)
    else:
        ctx.save_for_backward(grad_h, grad_w, grad_b, grad_u, grad_lw)


def _fused_linear_cross_entropy_grads(ctx, grad_out, *_):
    refuse_double_backward("fused_linear_cross_entropy")
    if ctx.reduction != "none":  # the forward computed the gradients; grad_output scales them
        grads = [scaled(g, grad_out) if needed else None for g, needed in zip(ctx.saved_tensors, ctx.need)]
    else:
        hidden, weight, bias, labels, lse, q, flag, row_w, u, lw, class_weights = ctx.saved_tensors
        grads = _fused_linear_cross_entropy_backward_op(grad_out, hidden, weight, bias, labels, lse, q, flag,
                                                        row_w if ctx.weighted else None, *ctx.options, u, lw,
                                                        *ctx.need[3:], class_weights)
        grads = [g if needed else None for g, needed in zip(grads, ctx.need)]
    # the inputs' gradients in schema order: hidden, weight, bias, 18 non-differentiable inputs, u, B, 4 flags
    return *grads[:3], *[None] * 18, *grads[3:], None, None, None, None


_fused_linear_cross_entropy_op.register_autograd(_fused_linear_cross_entropy_grads,
                                                 setup_context=_fused_linear_cross_entropy_setup)


def _traced_fused_linear_cross_entropy(hidden, weight, bias, labels, normalizer, class_weights, ignore_index,
                                       label_smoothing, z_loss, softcap, reduction, loss_scale, accum_dtype,
                                       return_target_rank, max_scratch_bytes, grad_filter_eps, want_z, want_accuracy,
                                       u, lw, use_token_scaling, want_predicted):
    """`fused_linear_cross_entropy`'s triton path while torch.compile traces: the custom op, outputs as the eager
    call's."""
    if _GRAD_CONSUMERS:
        raise RuntimeError("consume_weight_grad (optimizer-in-backward) hands dW over inside the loss's forward, "
                           "which a compiled graph cannot do: run that training step without torch.compile")
    if normalizer is not None:  # a tensor argument: a number would be baked into the graph
        normalizer = torch.as_tensor(normalizer)
    grad_on = torch.is_grad_enabled()
    need = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias, u, lw)]
    out = _fused_linear_cross_entropy_op(
        hidden, weight, bias, labels, normalizer, class_weights, ignore_index, float(label_smoothing), float(z_loss),
        None if softcap is None else float(softcap), reduction, float(loss_scale), accum_dtype, *need[:3],
        return_target_rank, max_scratch_bytes, None if grad_filter_eps is None else float(grad_filter_eps), want_z,
        want_accuracy, u, lw, *need[3:], use_token_scaling, want_predicted)
    loss, rank, z, accuracy, predicted = out[0], out[8], out[9], out[10], out[13]
    if want_z or want_accuracy or want_predicted:
        return LossOutput(loss, z if want_z else None, accuracy if want_accuracy else None,
                          rank if return_target_rank else None, predicted if want_predicted else None)
    return (loss, rank) if return_target_rank else loss


@on_input_device  # launches, the check's event and its pinned copy all on the logits' device
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
    loss_scale: float = 1.0,
    accum_dtype: torch.dtype = torch.float32,
    return_target_rank: bool = False,
    max_scratch_bytes: int | None = None,
    grad_filter_eps: float | None = None,
    class_weights: torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_token_scaling: bool = False,
    return_predicted_tokens: bool = False,
):
    """Cross-entropy of hidden (..., H) · weight (V, H)ᵀ (+ bias (V,)) (+ u·Bᵀ) against labels (...), never holding
    N×V.

    Returns the loss (0-dim fp32; fp32 of labels' shape for reduction="none") times loss_scale, and with
    return_target_rank=True also int32 ranks of labels' shape (logits above the target's, ties at a lower index
    included as argmax breaks them: 0 = top-1 correct; -1 at ignored positions). A weight with requires_grad=False
    gets no dW work; dW is accumulated in accum_dtype (float32, or the weight's dtype) and returned in the weight's
    dtype. A label outside [0, V) that is not ignore_index raises ValueError (the call waits for the check with its
    kernels queued, _labels.LabelCheck). max_scratch_bytes caps the logits scratch (default TUNING.max_scratch_bytes,
    none): a lower peak for more chunks. grad_filter_eps (default TUNING.grad_filter_eps, None: exact gradients) skips,
    per token chunk, the vocabulary columns whose every per-token loss gradient ∂ℓ_t/∂z_tj is below it in
    magnitude (an approximation for peaked distributions, as cut-cross-entropy's filter_eps; rule and cost in
    _grad_filter.py; the reference path treats all tokens as one chunk).
    class_weights, return_z_loss, return_token_accuracy: as in `cross_entropy` (per-class weights as a per-row scale
    of the same passes, read by the row kernel itself with label smoothing; with either return flag the result is a LossOutput, whose target_rank holds the ranks when
    return_target_rank is set too). No logits are formed for any of them.
    low_rank=(u, B): a low-rank term added to the logits, u (..., r) with hidden's leading shape, B (V, r), in
    hidden's dtype; a LoRA adapter on the head is u = s·A·drop(hidden), computed by the caller with ordinary autograd
    (the op returns du, which reaches A and hidden through it) and B = lora_B's weight. Every option above works with
    it; du and dB (accumulated in fp32, returned in B's dtype) are computed as dh and dW are, only where asked for.
    use_token_scaling, return_predicted_tokens: as in `cross_entropy` (each token's loss and gradient times its
    detached target probability; each token's argmax in LossOutput.predicted_tokens), with every option above; the
    predictions cost one more read of each chunk's logits, token scaling the CE pass in two launches.
    """
    check_options(reduction, label_smoothing, softcap, z_loss, normalizer)
    if hidden.dim() == 0:  # else an IndexError from hidden.shape[-1]
        raise ValueError("hidden must be (..., H), got a 0-dim tensor")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:  # V = 0: a division by 0
        raise ValueError(f"weight must be (V, {hidden.shape[-1]}) with V >= 1, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    u, lw = _check_low_rank(low_rank, hidden, weight)
    dtypes = {t.dtype for t in (hidden, weight, bias, u, lw) if t is not None}
    if len(dtypes) > 1 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden, weight, bias and low_rank must share one floating dtype, got "
                         f"{sorted(map(str, dtypes))}")
    if accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"accum_dtype must be torch.float32 or the weight's dtype, got {accum_dtype}")
    if max_scratch_bytes is not None and max_scratch_bytes < 1:
        raise ValueError(f"max_scratch_bytes must be a positive byte count or None, got {max_scratch_bytes}")
    grad_filter_eps = TUNING.grad_filter_eps if grad_filter_eps is None else grad_filter_eps
    if grad_filter_eps is not None and not 0 < grad_filter_eps < 1:  # also rejects NaN
        raise ValueError(f"grad_filter_eps must be None or in (0, 1), got {grad_filter_eps}")
    check_class_weights(class_weights, weight.shape[0], weight.device)
    labels = labels.contiguous()  # the kernel indexes labels by row: a strided view (a column, an expand) is copied
    triton_path = use_triton(hidden, weight, bias, labels, u, lw) and labels.numel() > 0
    if triton_path and torch.compiler.is_compiling():
        return _traced_fused_linear_cross_entropy(
            hidden, weight, bias, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss, softcap,
            reduction, loss_scale, accum_dtype, return_target_rank, max_scratch_bytes, grad_filter_eps,
            return_z_loss, return_token_accuracy, u, lw, use_token_scaling, return_predicted_tokens)
    labels_ok = LabelCheck(labels, weight.shape[0], ignore_index, reduction, normalizer, loss_scale)
    if not triton_path:
        labels_ok.wait()
        return fused_linear_cross_entropy_reference(
            hidden, weight, labels, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
            z_loss=z_loss, softcap=softcap, reduction=reduction, normalizer=normalizer, loss_scale=loss_scale,
            return_target_rank=return_target_rank, grad_filter_eps=grad_filter_eps, class_weights=class_weights,
            return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy, low_rank=low_rank,
            use_token_scaling=use_token_scaling, return_predicted_tokens=return_predicted_tokens,
        )
    grad_on = torch.is_grad_enabled()
    need = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias, u, lw))
    opts = row_kernel_options(ignore_index, label_smoothing, z_loss, softcap, labels_ok.flag, class_weights)
    row_w = _row_scales(labels, class_weights, ignore_index, reduction, normalizer, loss_scale, label_smoothing)
    extras = (return_z_loss, return_token_accuracy, return_predicted_tokens)
    out = _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, opts, reduction, float(loss_scale),
                                         accum_dtype, need, return_target_rank, labels_ok, max_scratch_bytes,
                                         None if grad_filter_eps is None else float(grad_filter_eps), row_w,
                                         extras, u, lw, use_token_scaling)
    labels_ok.wait()  # after every GEMM and CE pass is queued (they touch nothing if a label is bad)
    if not any(extras):
        return out
    out = list(out)
    loss = out.pop(0)
    rank = out.pop(0) if return_target_rank else None
    z, accuracy, predicted = (out.pop(0) if wanted else None for wanted in extras)
    return LossOutput(loss, z, accuracy, rank, predicted)


def _check_low_rank(low_rank, hidden: torch.Tensor, weight: torch.Tensor):
    """(u, B) of a valid low_rank argument, (None, None) without one."""
    if low_rank is None:
        return None, None
    if not isinstance(low_rank, (tuple, list)) or len(low_rank) != 2:
        raise ValueError(f"low_rank must be a pair (u (..., r), B (V, r)), got {type(low_rank).__name__}")
    u, lw = low_rank
    if not isinstance(u, torch.Tensor) or not isinstance(lw, torch.Tensor):
        raise ValueError("low_rank must be a pair of tensors (u (..., r), B (V, r))")
    if u.dim() != hidden.dim() or u.shape[:-1] != hidden.shape[:-1] or u.shape[-1] < 1:
        raise ValueError(f"low_rank's u must be (..., r) with hidden's leading shape {tuple(hidden.shape[:-1])} and "
                         f"r >= 1, got {tuple(u.shape)}")
    if lw.shape != (weight.shape[0], u.shape[-1]):
        raise ValueError(f"low_rank's B must be (V, r) = ({weight.shape[0]}, {u.shape[-1]}), got {tuple(lw.shape)}")
    return u, lw


class FusedLinearCrossEntropyLoss(nn.Module):
    """Module form of `fused_linear_cross_entropy`; weight, bias, the normaliser and the low-rank term are passed to
    forward."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: float | None = None, reduction: str = "mean", loss_scale: float = 1.0,
                 grad_filter_eps: float | None = None, use_token_scaling: bool = False):
        super().__init__()
        check_options(reduction, label_smoothing, softcap, z_loss)
        self.opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                         softcap=softcap, reduction=reduction, loss_scale=loss_scale, grad_filter_eps=grad_filter_eps,
                         use_token_scaling=use_token_scaling)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: torch.Tensor | None = None, normalizer=None,
                low_rank: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, weight, labels, bias, normalizer=normalizer, low_rank=low_rank,
                                          **self.opts)
