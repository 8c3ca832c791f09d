"""Label shifting for causal-LM and Medusa losses, aware of packed-document boundaries; the LM head GEMM's
operands under autocast."""

from __future__ import annotations

import torch


def shift_labels(labels: torch.Tensor, shift: int, position_ids: torch.Tensor | None = None,
                 ignore_index: int = -100) -> torch.Tensor:
    """(B, T) int64 targets: out[:, t] = labels[:, t + shift] if t + shift < T and no document starts in between.

    With position_ids, a target counts only when position_ids[t + shift] == position_ids[t] + shift, so no loss
    term at the end of one packed document targets a token of the next. shift=1 is the causal-LM shift; Medusa
    head k (1-based) uses shift k + 1.
    """
    if shift < 1:
        raise ValueError(f"shift must be >= 1, got {shift}")
    labels = labels.long()
    out = torch.full_like(labels, ignore_index)
    if shift >= labels.shape[-1]:
        return out
    out[:, :-shift] = labels[:, shift:]
    if position_ids is not None:
        position_ids = position_ids.expand_as(labels)
        same_doc = position_ids[:, shift:] == position_ids[:, :-shift] + shift
        out[:, :-shift] = torch.where(same_doc, out[:, :-shift], ignore_index)
    return out


def autocast_operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, weight) for a fused linear-CE head: under torch.autocast both in autocast's dtype, as nn.Linear's
    GEMM would run (float32 parameters, bf16 activations: the fused op takes one dtype); else unchanged. The casts
    are differentiable, so a float32 weight still gets its float32 gradient."""
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        return hidden.to(dtype), weight.to(dtype)
    return hidden, weight
