"""Cross-entropy on materialised logits: online softmax, one pass, gradient written in place.

Math per row x (length V, fp32 whatever the input dtype), target t, ε = label_smoothing, z = z_loss:
  softcap c:  x ← c·tanh(x / c)                         (Gemma-2 final-logit soft-capping)
  lse = log Σ_j exp(x_j)
  loss = (1−ε)·(lse − x_t) + ε·(lse − mean_j x_j) + z·lse²     (PyTorch / HF label smoothing: ε spread as ε/V)
  dloss/dx_j = p_j·(1 + 2z·lse) − ε/V − (1−ε)·[j = t]        (× (1 − (x_j/c)²) through the softcap)
Rows whose label is ignore_index contribute 0 to the loss and get a zero gradient. reduction="mean" divides the
sum by `normalizer` when given (the global count of non-ignored tokens, for gradient accumulation / data
parallelism) or else by the local count; a zero denominator counts as 1 (every label ignored → loss 0, no NaN).

HF numerics matched: HF upcasts the logits to fp32 and calls F.cross_entropy; the kernel reads bf16 and does all
math in fp32. Confident predictions: p_t − 1 is never formed by subtraction (it would round to 0 in fp32 once
p_t > 1 − 6e-8); the kernel keeps Σ_{j≠t} e^{x_j−m} separately, so 1 − p_t = Σ_{j≠t} p_j is exact to fp32
relative precision and the loss uses log1p.

Kernel and in-place contract: see _ce_core.py (shared with fused_linear_cross_entropy).
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch cross-entropy with every option of `cross_entropy`; math in fp32 (float64 stays float64)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    x = x.reshape(-1, x.shape[-1])
    labels = labels.reshape(-1)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = (1.0 - label_smoothing) * (lse - x.gather(-1, target[:, None]).squeeze(-1))
    if label_smoothing:
        loss = loss + label_smoothing * (lse - x.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return reduce_loss(loss, valid, reduction, normalizer)


def reduce_loss(
    loss: torch.Tensor, valid: torch.Tensor, reduction: str, normalizer: float | torch.Tensor | None
) -> torch.Tensor:
    """Per-token losses (zero at ignored rows) → the requested reduction, without a host sync."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / mean_denominator(valid, normalizer, loss.dtype)


def mean_denominator(valid: torch.Tensor, normalizer: float | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The divisor of reduction="mean" as a 0-dim device tensor; 0 counts as 1 so all-ignored gives loss 0."""
    if normalizer is None:
        denom = valid.sum().to(dtype)
    else:
        denom = torch.as_tensor(normalizer, dtype=dtype, device=valid.device)
    return torch.where(denom == 0, torch.ones_like(denom), denom)


def check_options(reduction: str, label_smoothing: float, softcap: float | None) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")


def check_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise ValueError for a label outside [0, V) that is not ignore_index.

    One fused reduction and one host sync (``.item()``) per call: the kernels index the logits with the label, so
    a bad label must be caught before they run rather than read out of bounds.
    """
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 (or int32), got {labels.dtype}")
    bad = ((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)
    if bad.any().item():
        first = labels[bad][0].item()
        raise ValueError(
            f"label {first} is outside the vocabulary [0, {vocab_size}) and is not ignore_index={ignore_index}"
        )


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits (N, V) against int64 labels (N,), with the options of the module docstring.

    Returns a 0-dim fp32 loss, or (N,) fp32 per-token losses for reduction="none".
    """
    check_options(reduction, label_smoothing, softcap)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    check_labels(labels, logits.shape[-1], ignore_index)
    use_triton(logits, labels)  # validates devices; the Triton path follows
    return cross_entropy_reference(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, reduction=reduction, normalizer=normalizer,
    )
