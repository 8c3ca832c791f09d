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
  Functions do not (benchmarks/tools/custom_op_overhead.py measures it).
- Inductor runs each op as a fallback kernel (an extern call). It is registered as one before Inductor lowers a
  graph (``_register_inductor_fallbacks``), not left to Inductor's implicit fallback: that path formats the op's
  input IR into a log message, eagerly whatever the log level in torch 2.11 (lazily in 2.13), and our ops' IR is a
  chain of extern kernels, each printed with all its inputs, so the message for the first op met after the last
  layer (the final norm, the loss) grows about tenfold per layer: a 16-layer step never finished compiling.
"""

from __future__ import annotations

import functools
import sys

import torch

NAMESPACE = "liger_models"
_OP_NAMES: list[str] = []  # every op custom_op defined, by name in NAMESPACE


def custom_op(name: str):
    """``torch.library.custom_op`` in this package's namespace, for a functional op (no mutated arguments).

    The op's fake implementation (``register_fake``) first registers every op of this package as an Inductor
    fallback, when Inductor is loaded and they are not yet: fake implementations run while AOT autograd traces the
    graph, before Inductor lowers it (see the module docstring)."""
    define = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())

    def wrap(fn):
        op = define(fn)
        _OP_NAMES.append(name)
        register_fake = op.register_fake

        def register_fake_registering_fallbacks(fake):
            @functools.wraps(fake)
            def fake_impl(*args, **kwargs):
                _register_inductor_fallbacks()
                return fake(*args, **kwargs)

            return register_fake(fake_impl)

        op.register_fake = register_fake_registering_fallbacks
        return op

    return wrap


def _register_inductor_fallbacks() -> None:
    """Register this package's ops Inductor has no lowering for as its fallback kernels, with the layout constraint
    Inductor's implicit fallback would give them (the op's tag, else Inductor's default), so a compiled graph runs
    what it ran before; only the log line that formats the op's inputs is skipped. Does nothing until Inductor is
    loaded; should its internals differ, leaves the ops to the implicit fallback. Runs only while a graph is traced
    (a fake implementation's call): a dict lookup per op."""
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None:
        return
    try:
        from torch._library.utils import get_layout_constraint_tag

        for name in _OP_NAMES:
            op = getattr(getattr(torch.ops, NAMESPACE), name).default
            if op not in lowering.lowerings:
                tag = get_layout_constraint_tag(op, with_default=True)
                lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))
    except (AttributeError, ImportError, TypeError):
        pass


def absent(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output it was not asked for (a schema has no optional returns)."""
    return like.new_empty(0)


def refuse_double_backward(name: str) -> None:
    """The ops' backwards run kernels autograd cannot see: under create_graph=True (grad mode on in a backward)
    their gradients would silently lose every second-order term (see _dispatch.once_differentiable)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{name}: backward with create_graph=True (double backward) is not supported; its "
                           "gradients are not differentiable")
