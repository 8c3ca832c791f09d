"""Fused linear + cross-entropy: loss of (h·Wᵀ + b) against labels without the N×V logits.

(Design notes and the Triton path follow; this revision is the exact PyTorch reference path.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cross_entropy import check_labels, check_options, cross_entropy_reference


def target_rank_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                          softcap: float | None = None) -> torch.Tensor:
    """int32 (N,): how many vocab entries have a logit strictly greater than the target's; -1 where ignored."""
    x = logits.reshape(-1, logits.shape[-1]).float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    target = x.gather(-1, torch.where(valid, labels, 0)[:, None])
    rank = (x > target).sum(-1).to(torch.int32)
    return torch.where(valid, rank, torch.full_like(rank, -1))


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
    return_target_rank: bool = False,
):
    """Eager PyTorch: logits = F.linear(h, W, b) in the input dtype (as HF's lm_head), then fp32 cross-entropy."""
    h = hidden.reshape(-1, hidden.shape[-1])
    logits = F.linear(h, weight, bias)
    loss = cross_entropy_reference(
        logits, labels.reshape(-1), ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, reduction=reduction, normalizer=normalizer,
    )
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    loss = loss * loss_scale
    if not return_target_rank:
        return loss
    with torch.no_grad():
        rank = target_rank_reference(logits, labels, ignore_index, softcap).reshape(labels.shape)
    return loss, rank


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
):
    """Cross-entropy of hidden (..., H) · weight (V, H)ᵀ (+ bias) against labels (...), never holding N×V logits.

    Returns the loss (0-dim fp32; per-token fp32 of labels' shape for reduction="none"), times loss_scale, and
    with return_target_rank=True also int32 ranks of labels' shape (0 = top-1 correct, -1 at ignored positions).
    """
    check_options(reduction, label_smoothing, softcap)
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, {hidden.shape[-1]}), got {tuple(weight.shape)}")
    check_labels(labels, weight.shape[0], ignore_index)
    return fused_linear_cross_entropy_reference(
        hidden, weight, labels, bias, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, reduction=reduction, normalizer=normalizer, loss_scale=loss_scale,
        return_target_rank=return_target_rank,
    )
