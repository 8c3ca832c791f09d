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

Earlier still, in the forward: linear-CE computes its weight's gradient during the forward pass. For a weight no
other op uses (Medusa's copied head lm_heads, an untied lm_head) ``in_forward`` has that gradient handed over and
stepped right there (kernels' ``consume_weight_grad``), so no such V×H gradient lives until backward: at the end of a
Medusa forward only one head's dW exists at a time instead of all of them. Same update, same bits; the loss must be
backpropagated with gradient 1 (linear-CE checks), and any forward run with gradients enabled is a training step
for these weights (evaluate under ``torch.no_grad()``). A weight that gets a second gradient in the same step (a tied
embedding, a shared head) raises instead of being stepped twice. A forward whose loss never reaches backward (it
raised later on, or its loss was dropped) leaves its update done, and the next forward starts a new step; while
that loss is still alive (it may yet be backpropagated, with this one) the second forward raises before updating.

What it rules out (checked by the trainer): gradient accumulation over micro-batches (the gradient is gone after
each backward), clipping by the global gradient norm (no moment has all gradients), and FSDP (it writes sharded
gradients outside autograd's accumulation).
"""

from __future__ import annotations

import functools
import weakref
from typing import Iterable

import torch

from liger_models.kernels.ops.fused_linear_cross_entropy import consume_weight_grad


class OptimizerInBackward:
    """Hooks ``optimizer``'s parameters so that ``loss.backward()`` also performs ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``; the ``in_forward`` ones (linear-CE weights no other op uses) are stepped in
    the forward, as soon as linear-CE has their gradient. Call :meth:`remove` to go back to ordinary stepping."""

    def __init__(self, optimizer: torch.optim.Optimizer, in_forward: Iterable[torch.Tensor] = ()) -> None:
        self.optimizer = optimizer
        self._group_of: dict[torch.Tensor, int] = {}  # torch.optim already refuses a parameter in two groups
        self._stepped: set[torch.Tensor] = set()  # updated this step; cleared when the step's backward ends
        # stepped in a forward whose loss has not reached backward yet → weak reference to that loss's autograd node
        self._awaiting: dict[torch.Tensor, weakref.ref] = {}
        self._end_queued: weakref.ref | None = None  # the end callback queued on the backward now running
        self._handles = []
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._group_of[p] = i
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad).remove)
        for p in in_forward:
            if p not in self._group_of:
                raise ValueError(f"an in_forward parameter of shape {tuple(p.shape)} is not in the optimizer")
            self._handles.append(consume_weight_grad(p, functools.partial(self._on_forward_grad, p)))

    def remove(self) -> None:
        for undo in self._handles:
            undo()
        self._handles.clear()

    def _in_backward(self) -> None:
        """Called from inside a backward: clear the step's record once that backward ends."""
        self._forget_failed_backward()
        if self._end_queued is None:
            end = self._end_backward  # one bound method: autograd holds it, the weak reference watches it
            torch.autograd.Variable._execution_engine.queue_callback(end)
            self._end_queued = weakref.ref(end)

    def _forget_failed_backward(self) -> None:
        """A backward that raised never runs its end callback, but autograd drops it with the backward: the
        updates it made are done (and stay so), so the next step must not count them as this step's."""
        if self._end_queued is not None and self._end_queued() is None:
            self._end_backward()

    def _end_backward(self) -> None:
        self._stepped.clear()
        self._awaiting.clear()
        self._end_queued = None

    def _update(self, p: torch.Tensor, when: str, grad: torch.Tensor | None = None) -> None:
        if p in self._stepped:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} received a second gradient {when} after its update this "
                "step (a tied or shared weight stepped in the forward, or reentrant checkpointing); the optimizer "
                "step in backward needs each parameter's whole gradient at once, one backward per step")
        if grad is not None:
            p.grad = grad
        self._step_only(p)
        self._stepped.add(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._in_backward()
        if p.grad is None:  # the hook also fires for an op that returned no gradient (linear-CE after handing dW over)
            return
        self._update(p, "in backward")

    def _on_forward_grad(self, p: torch.Tensor, grad: torch.Tensor | None, node: object) -> None:
        if grad is None:  # linear-CE's backward ran: p's step belongs to this backward
            self._in_backward()
            return
        self._forget_failed_backward()  # a forward's first update after a failed step (a backward's: _in_backward)
        earlier = self._awaiting.get(p)
        if earlier is not None and self._end_queued is None and earlier() is None:
            # No backward since p's last update in a forward, and that forward's loss is gone: it never reached
            # backward (it raised later on, or was dropped). Its update stays done; this forward is the next step's.
            # A loss still alive may yet be backpropagated (with this one): _update refuses the second gradient.
            self._stepped.discard(p)
        self._update(p, "in the forward", grad)
        self._awaiting[p] = weakref.ref(node)

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
