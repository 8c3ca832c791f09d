"""The kernels as ``torch.library`` custom ops, so that ``torch.compile`` traces a training step without a graph break.

Dynamo cannot trace a Triton launch through this package's launchers (``_launch.py`` reads pointers and calls the
compiled binary), so each Function is also registered as custom ops: a functional forward op whose extra outputs are
what the backward needs, a backward op, a fake (shape-only) implementation of each, and ``register_autograd`` tying
them together. The ops' implementations call the same launchers as the Functions, so a compiled graph runs the same
kernels with the same numerics. ``triton_op`` would let Inductor see the kernels themselves, but it needs
``kernel[grid]`` calls on JIT functions, which neither the fast launcher nor Triton's interpreter (CI) provides.

What differs under compile, and why:
- Ops are functional: a custom op with autograd may not mutate its inputs or return views of them. So RoPE returns
  rotated copies instead of rotating the projection output in place, and gradients that eager writes over an input's
  memory (the gated activation's d gate_up, cross-entropy's d logits) come in fresh tensors; Inductor's own buffer
  reuse decides about that memory.
- The eager public functions call the Functions directly and take the op path only while compiling
  (``torch.compiler.is_compiling()``): dispatching through a custom op with autograd costs host time that the
  Functions do not (measured in docs/kernels.md#torchcompile).
"""

from __future__ import annotations

import torch

NAMESPACE = "liger_models"


def custom_op(name: str):
    """``torch.library.custom_op`` in this package's namespace, for a functional op (no mutated arguments)."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


def absent(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output it was not asked for (a schema has no optional returns)."""
    return like.new_empty(0)


def refuse_double_backward(name: str) -> None:
    """The ops' backwards run kernels autograd cannot see: under create_graph=True (grad mode on in a backward)
    their gradients would silently lose every second-order term (see _dispatch.once_differentiable)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{name}: backward with create_graph=True (double backward) is not supported; its "
                           "gradients are not differentiable")
