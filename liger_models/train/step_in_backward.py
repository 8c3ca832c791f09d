"""The optimizer step inside backward: each parameter is updated as soon as its gradient is complete, and that
gradient is freed at once, so a step never holds the whole model's gradients at the same time.

Why: with bf16 AdamW the gradients are a quarter of the training state (weights + gradients + two moments), and at
the end of a normal backward they all exist together. Stepping each parameter from a post-accumulate-grad hook
keeps only the gradients still in flight. For Medusa stage 1 with five copied lm_heads (128256 × 4096 each) that is
one head's gradient (1 GiB) instead of five; for an 8-layer Llama-3-8B-width model it is 5.2 GiB.

Exactness: the update is the same ``optimizer.step()`` call restricted to one parameter (its group's other
parameters are hidden for the call), so every per-parameter optimizer (AdamW, SGD, Adam, ...: their math is
elementwise per tensor) gives bit-identical weights. The optimizer object, its state_dict and an LR scheduler on it
work unchanged.

When a gradient is complete: autograd sums every use of a leaf (a tied embedding / lm_head, a Medusa head's shared
weight) into one AccumulateGrad call per backward, so the hook fires once, with the whole gradient. A second call
in the same backward (a nested backward, e.g. reentrant activation checkpointing) would find the parameter already
updated, and raises instead of stepping twice.

What it rules out (checked by the trainer): gradient accumulation over micro-batches (the gradient is gone after
each backward), clipping by the global gradient norm (no moment has all gradients), and FSDP (it writes sharded
gradients outside autograd's accumulation).
"""

from __future__ import annotations

import torch


class OptimizerInBackward:
    """Hooks ``optimizer``'s parameters so that ``loss.backward()`` also performs ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``. Call :meth:`remove` to go back to ordinary stepping."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group_of: dict[torch.Tensor, int] = {}  # torch.optim already refuses a parameter in two groups
        self._stepped: set[torch.Tensor] = set()  # this backward's updated parameters; empty between backwards
        self._handles = []
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._group_of[p] = i
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._stepped:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(self._stepped.clear)  # runs when backward ends
        elif p in self._stepped:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} received a second gradient in one backward after its "
                "update; the optimizer step in backward needs one backward per step (no reentrant checkpointing)")
        self._step_only(p)
        self._stepped.add(p)

    def _step_only(self, p: torch.Tensor) -> None:
        groups = self.optimizer.param_groups
        owner = self._group_of[p]
        kept = [g["params"] for g in groups]
        try:
            for i, g in enumerate(groups):
                g["params"] = [p] if i == owner else []
            self.optimizer.step()
        finally:
            for g, params in zip(groups, kept):
                g["params"] = params
        p.grad = None
