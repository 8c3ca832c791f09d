"""Medusa training loss: loss = w0·CE_0 + Σ_k λ0·decay^k·sched(step)·CE_k, no logits ever materialised.

CE_0 is the base head (hidden at t → label t+1); CE_k is Medusa head k = 1..K on its ResBlock output z_k
(position t → label t+k+1). Every term runs through `fused_linear_cross_entropy` on the *labels* shifted by
`shift_labels` (which also masks targets across packed-document boundaries, where `position_ids` restart), with the
term's weight as the kernel's `loss_scale` so gradients come out pre-scaled, and `return_target_rank=True` for the
per-head top-1 / top-5 counts. Weights and schedules follow the axolotl Medusa-2 fork (docs/medusa.md#loss-and-stages):
λ_k = heads_coefficient · decay_coefficient^k for k = 1..K; sched ∈ constant, linear, sine, sine_<r>.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from liger_models.medusa.config import check_scheduler
from liger_models.medusa.heads import MedusaHeads
from liger_models.modules import autocast_operands, model_output, shift_labels

Normalizer = float | torch.Tensor | Sequence[float | torch.Tensor] | None


@model_output
@dataclass
class MedusaOutput:
    """What `MedusaModel.forward` returns. In training every tensor except `loss` is detached (the metrics); nothing
    syncs with the host. The inference logits are not detached, as a plain model's logits are not.

    loss: the scalar to backward. base_loss: the base head's CE (None when its weight is 0, e.g. stage 1).
    head_losses: (K,) unweighted CE per head. head_top1 / head_top5 / head_count: (K,) int64 counts of targets whose
    logit ranks first / in the top 5, and of non-ignored targets. logits / head_logits: only without labels
    (inference): (B, T, V) and (K, B, T, V). aux_loss: a mixture-of-experts base's load-balancing loss, in stage 2
    where its config sets ``output_router_logits`` (``loss`` holds it times ``router_aux_loss_coef``).
    """

    loss: torch.Tensor | None = None
    base_loss: torch.Tensor | None = None
    head_losses: torch.Tensor | None = None
    head_top1: torch.Tensor | None = None
    head_top5: torch.Tensor | None = None
    head_count: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    head_logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def medusa_head_weights(num_heads: int, lambda0: float = 0.2, decay: float = 0.8) -> list[float]:
    """λ_k = lambda0 · decay^k for heads k = 1..num_heads (the fork's `decay^i` for head index i ≥ 1)."""
    return [lambda0 * decay**k for k in range(1, num_heads + 1)]


def schedule_factor(name: str, step: int, max_steps: int) -> float:
    """The heads' warm-up factor at `step` of `max_steps`.

    constant: 1. linear: step/max_steps. sine: sin(π/2 · step/max_steps). sine_<r>: the sine ramp over the first
    fraction r of training, then 1. Progress is clamped to [0, 1].
    """
    check_scheduler(name)
    if name == "constant":
        return 1.0
    progress = min(max(step / max(max_steps, 1), 0.0), 1.0)
    if name == "linear":
        return progress
    span = 1.0 if name == "sine" else float(name[len("sine_"):])
    return math.sin(math.pi / 2 * min(progress / span, 1.0))


def medusa_target_counts(labels: torch.Tensor, num_heads: int, position_ids: torch.Tensor | None = None,
                         ignore_index: int = -100) -> torch.Tensor:
    """(K+1,) int64 counts of non-ignored targets of the base head and each Medusa head.

    Summed over every micro-batch of a global batch (and all-reduced across ranks), these are the per-term
    `normalizer`s that make gradient accumulation equal one big batch.
    """
    return torch.stack([(shift_labels(labels, s, position_ids, ignore_index) != ignore_index).sum()
                        for s in range(1, num_heads + 2)])


def _term_normalizers(normalizer: Normalizer, num_terms: int) -> list | None:
    """One normalizer per term (index 0 the base head), or None (each term's mean over its own targets).

    A single number serves every term, and so does a one-element tensor: an all-reduced count is often shaped (1,),
    and indexing it per term would fail at head 1. A sequence must have exactly one entry per term: a (K,) list of
    the heads' counts without the base's would otherwise silently give head k the count of head k + 1.
    """
    if normalizer is None:
        return None
    if isinstance(normalizer, numbers.Real):
        return [normalizer] * num_terms
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() == 1:
            return [normalizer.reshape(())] * num_terms
        if normalizer.dim() != 1 or normalizer.shape[0] != num_terms:
            raise ValueError(f"normalizer of shape {tuple(normalizer.shape)}: expected one count or {num_terms} "
                             f"per-term counts (the base head's first, then each Medusa head's)")
        return list(normalizer.unbind())
    per_term = list(normalizer)
    if len(per_term) != num_terms:
        raise ValueError(f"{len(per_term)} normalizers: expected one count or {num_terms} per-term counts "
                         f"(the base head's first, then each Medusa head's)")
    return per_term


def _term_normalizer(normalizers: list | None, i: int, targets: torch.Tensor, ignore_index: int):
    """Term i's normalizer, clamped to ≥ 1: a term without targets (short sequences, late heads, an empty global
    count) then gives 0 instead of 0/0."""
    n = (targets != ignore_index).sum() if normalizers is None else normalizers[i]
    return n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)


def _weighted_ce(hidden, weight, targets, scale: float, normalizer, ignore_index: int, softcap: float | None = None):
    """(weighted loss for the total, unweighted CE detached, target rank).

    A zero weight (a warm-up schedule at step 0) runs the term with loss_scale 0, so backward() has a graph and the
    gradients are exactly zero (as in the reference implementations), and reports the CE from a second, no-grad
    call. Not "scale 1, then × 0": linear-CE may hand dW to an optimizer step inside the forward (step_in_backward),
    before any later factor could reach it.
    """
    hidden, weight = autocast_operands(hidden, weight)
    loss, rank = fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, normalizer=normalizer,
                                            loss_scale=scale, return_target_rank=True, softcap=softcap)
    if scale == 0:
        with torch.no_grad():
            ce = fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, normalizer=normalizer,
                                            softcap=softcap)
        return loss, ce, rank
    return loss, loss.detach() / scale, rank


def medusa_loss(hidden: torch.Tensor, heads: MedusaHeads, labels: torch.Tensor, *,
                position_ids: torch.Tensor | None = None, base_lm_head_weight: torch.Tensor | None = None,
                base_loss_weight: float = 0.0, head_scales: Sequence[float], normalizer: Normalizer = None,
                ignore_index: int = -100, base_logit_softcap: float | None = None) -> MedusaOutput:
    """The combined Medusa loss on the base's final hidden states `hidden` (B, T, H); labels (B, T) HF-aligned.

    head_scales: λ_k·sched(step) per head. base_loss_weight: w0 (the base term is skipped when 0).
    normalizer: None (mean over each term's local non-ignored targets), one number / one-element tensor for every
    term, or a (K+1,) sequence / tensor of per-term counts (index 0 the base head), e.g. from `medusa_target_counts`
    (in stage 1 too, where entry 0 goes unused); any other length raises a ValueError.
    base_logit_softcap: the base model's final-logit soft-cap (Gemma 2's ``config.logit_softcap``), applied inside
    the base term's loss kernel as the base model's own loss does; the heads' logits are not capped (they are new).
    """
    K = heads.num_heads
    if len(head_scales) != K:
        raise ValueError(f"{len(head_scales)} head scales for {K} Medusa heads")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape[:-1])}")
    normalizers = _term_normalizers(normalizer, K + 1)
    total = None
    base_loss = None
    if base_loss_weight != 0:
        if base_lm_head_weight is None:
            raise ValueError("a base loss weight needs the base lm_head weight")
        targets = shift_labels(labels, 1, position_ids, ignore_index)
        total, base_loss, _ = _weighted_ce(hidden, base_lm_head_weight, targets, base_loss_weight,
                                           _term_normalizer(normalizers, 0, targets, ignore_index), ignore_index,
                                           base_logit_softcap)
    losses, top1, top5, count = [], [], [], []
    for k in range(K):
        targets = shift_labels(labels, k + 2, position_ids, ignore_index)  # head k+1 predicts t + k + 2
        n = _term_normalizer(normalizers, k + 1, targets, ignore_index)
        weighted, ce, rank = heads.run(k, hidden, lambda z, w: _weighted_ce(z, w, targets, head_scales[k], n,
                                                                             ignore_index))
        total = weighted if total is None else total + weighted
        losses.append(ce)
        top1.append((rank == 0).sum())
        top5.append(((rank >= 0) & (rank < 5)).sum())
        count.append((targets != ignore_index).sum())
    return MedusaOutput(loss=total, base_loss=base_loss, head_losses=torch.stack(losses),
                        head_top1=torch.stack(top1).long(), head_top5=torch.stack(top5).long(),
                        head_count=torch.stack(count).long())
