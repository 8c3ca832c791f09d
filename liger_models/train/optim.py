"""AdamW with linear warmup then cosine decay, and the usual weight-decay parameter groups.

Precision: AdamW keeps its moments in the parameters' dtype, so ``--dtype bf16`` is pure-bf16 training (bf16
weights, gradients and moments, as in nanoGPT-style bf16 runs and torchtitan without mixed precision). It halves the
optimizer memory; the cost is that an update smaller than the weight's bf16 spacing (2^-8 relative) is lost, which
matters for long runs at small learning rates. ``--dtype fp32`` keeps everything in fp32.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from liger_models.kernels._dispatch import use_triton
from liger_models.kernels.ops.adamw import adamw_step_
from liger_models.train.bnb_optim import build_bnb_adamw


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


IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable")


def with_live_flags(saved_groups: list[dict], live_groups: list[dict]) -> list[dict]:
    """Saved param groups carrying the live optimizer's implementation flags. torch takes the flags from the saved
    state, and from them where each step count goes; they describe the optimizer, not the state (a CUDA
    checkpoint resumes on CPU, torch's AdamW state loads into a capturable FusedAdamW). Extra saved groups are kept
    for torch to refuse."""
    merged = [{**saved, **{k: live[k] for k in IMPLEMENTATION_FLAGS if k in live}}
              for saved, live in zip(saved_groups, live_groups)]
    return merged + list(saved_groups[len(live_groups):])


class FusedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused) whose step runs liger_models/kernels/ops/adamw.py: one pass per parameter tensor at the copy rate
    (torch's multi-tensor kernel streams at ~60% of it on the H200; BENCHMARKS.md). Same math in fp32, same
    state (step as a 0-dim fp32 tensor on the parameter's device, exp_avg, exp_avg_sq) and state_dict, so
    checkpoints move freely between the two. Anything the kernel does not cover — a parameter that is not a plain
    contiguous CUDA tensor (an FSDP2 DTensor), a learning rate that is not a float or a 0-dim fp32 tensor on the
    parameters' device, amsgrad / maximize / Adam's coupled decay, a β of 0, AMP's grad scaling — makes that step
    torch's own. A tensor learning rate (cuda_graph.py turns each group's into one before a capture) is read by the
    kernel on the device."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, capturable: bool = False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True,
                         capturable=capturable)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim.AdamW's default (foreach) state would keep the step count on the CPU, where the kernel cannot
        # read it for a CUDA parameter, and capturable=False would make a CUDA graph refuse this optimizer.
        groups = with_live_flags(state_dict["param_groups"], self.param_groups)
        super().load_state_dict({**state_dict, "param_groups": groups})

    def _kernel_covers(self) -> bool:
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            return False  # AMP's GradScaler hands a fused optimizer its scale through these
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                return False
            if not group.get("decoupled_weight_decay", True):
                return False  # torch's Adam L2 decay (a group or state_dict saying so): the kernel's is AdamW's
            if not all(0.0 < b < 1.0 for b in group["betas"]):
                return False  # β = 0 is torch's to take (the kernel's bias correction needs ln β)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or lr.dtype != torch.float32):
                return False
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if type(p) not in (nn.Parameter, torch.Tensor) or type(g) is not torch.Tensor:
                    return False  # a tensor subclass (an FSDP2 DTensor): torch's path knows its layout
                if not use_triton(p) or g.is_sparse or g.dtype != p.dtype:
                    return False
                if isinstance(lr, torch.Tensor) and lr.device != p.device:
                    return False
                if not (p.is_contiguous() and g.is_contiguous()):
                    return False
        return True

    @torch.no_grad()
    def step(self, closure=None):
        # The closure makes this step's gradients: which path covers them can only be judged after it has run.
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._kernel_covers():
            super().step()
            return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            todo = [p for p in group["params"] if p.grad is not None]
            states = [self._state_of(p) for p in todo]
            if not states:
                continue
            torch._foreach_add_([s["step"] for s in states], 1.0)  # one launch for the group's step counts
            for p, s in zip(todo, states):
                adamw_step_(p, p.grad, s["exp_avg"], s["exp_avg_sq"], s["step"], lr=group["lr"], beta1=beta1,
                            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        return loss

    def _state_of(self, p: torch.Tensor) -> dict:
        """p's AdamW state, created as torch's fused AdamW creates it on first use."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def build_adamw(
    param_groups: list[dict],
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    capturable: bool = False,
    kernel: bool = True,
) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` (each carries its own lr / weight_decay). On CUDA: FusedAdamW, or with
    kernel=False torch's own fused AdamW (same math and state; `--adamw torch`). capturable: keep the step count
    on the GPU, so a CUDA graph can hold the step (cuda_graph.py)."""
    params = [p for g in param_groups for p in g["params"]]
    if not params:
        raise ValueError("nothing to train: no parameter requires a gradient")
    if all(p.is_cuda for p in params):
        if kernel:
            return FusedAdamW(param_groups, betas=betas, eps=eps, capturable=capturable)
        return torch.optim.AdamW(param_groups, betas=betas, eps=eps, fused=True, capturable=capturable)
    return torch.optim.AdamW(param_groups, betas=betas, eps=eps)


def build_optimizer(
    name: str,
    param_groups: list[dict],
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    capturable: bool = False,
    kernel: bool = True,
    embeddings: Sequence[torch.Tensor] = (),
) -> torch.optim.Optimizer:
    """``--optimizer name`` over ``param_groups``: :func:`build_adamw` for ``adamw`` (``capturable`` and ``kernel``
    are its), else bitsandbytes' optimizer of that name (bnb_optim.py), which neither option applies to; there the
    ``embeddings`` (trained embedding weights) keep 32-bit moments."""
    if name == "adamw":
        return build_adamw(param_groups, betas=betas, eps=eps, capturable=capturable, kernel=kernel)
    if capturable:
        raise ValueError(f"--optimizer {name} cannot be held in a CUDA graph (bitsandbytes' step is not capturable)")
    if not any(g["params"] for g in param_groups):
        raise ValueError("nothing to train: no parameter requires a gradient")
    return build_bnb_adamw(name, param_groups, betas=betas, eps=eps, full_precision=embeddings)


def trained_embeddings(model: nn.Module) -> list[torch.Tensor]:
    """The weights of ``model``'s embedding modules that train (a tied lm_head shares its embedding's)."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and m.weight.requires_grad]


def warmup_cosine_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear ramp over ``warmup_steps`` (1/warmup_steps at step
    0, the peak at the warmup's last step), then cosine to ``min_lr_ratio`` at the last step, ``max_steps - 1``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    # The cosine starts at the step that is at the peak (the warmup's last, else step 0) and ends at the last step
    # that runs: measured from step warmup_steps to max_steps, the peak came twice and the floor never.
    start = max(warmup_steps - 1, 0)
    progress = min(1.0, (step - start) / max(1, max_steps - 1 - start))
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
