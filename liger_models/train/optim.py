"""AdamW with linear warmup then cosine decay, and the usual weight-decay parameter groups.

Precision: AdamW keeps its moments in the parameters' dtype, so ``--dtype bf16`` is pure-bf16 training (bf16
weights, gradients and moments, as in nanoGPT-style bf16 runs and torchtitan without mixed precision). It halves the
optimizer memory; the cost is that an update smaller than the weight's bf16 spacing (2^-8 relative) is lost, which
matters for long runs at small learning rates. ``--dtype fp32`` keeps everything in fp32.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def decay_param_groups(model: nn.Module, lr: float, weight_decay: float) -> list[dict]:
    """Trainable matrices get weight decay; biases, norm weights (all 1-D tensors) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "lr": lr, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "lr": lr, "weight_decay": 0.0, "name": "no_decay"})
    return [g for g in groups if g["params"]]


def build_adamw(
    param_groups: list[dict],
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    capturable: bool = False,
) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (each carries its own lr / weight_decay); fused when every param is on CUDA.
    capturable: keep the step count on the GPU, so a CUDA graph can hold the step (cuda_graph.py)."""
    params = [p for g in param_groups for p in g["params"]]
    if not params:
        raise ValueError("nothing to train: no parameter requires a gradient")
    on_cuda = all(p.is_cuda for p in params)
    return torch.optim.AdamW(param_groups, betas=betas, eps=eps, fused=on_cuda or None,
                             capturable=capturable and on_cuda)


def warmup_cosine_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear ramp over ``warmup_steps``, then cosine to
    ``min_lr_ratio`` at ``max_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying :func:`warmup_cosine_factor` to every group's own base lr (so a head multiplier holds)."""
    if warmup_steps < 0 or max_steps < 1:
        raise ValueError(f"need warmup_steps ≥ 0 and max_steps ≥ 1, got {warmup_steps}, {max_steps}")

    def factor(step: int) -> float:
        return warmup_cosine_factor(step, warmup_steps, max_steps, min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
