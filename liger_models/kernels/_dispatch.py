"""Where a kernel runs: Triton on CUDA tensors, the PyTorch reference on CPU tensors.

Under ``TRITON_INTERPRET=1`` Triton's interpreter executes the real kernels on CPU tensors; that is how CI
tests every kernel without a GPU. A CUDA tensor never silently falls back to the reference path: only when asked
(``LIGER_MODELS_REFERENCE=1`` in the environment, or inside ``with reference_mode():``) does every op run its
PyTorch reference on any device, and the fused training paths compose the plain modules, so a numerical problem
can be bisected to a kernel (fusion off, then on per op) without changing the model code.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

_REFERENCE_MODE = [0]  # depth of nested reference_mode() blocks (process-wide, as the environment variable is)


def reference_forced() -> bool:
    """True when every op must run its PyTorch reference (``LIGER_MODELS_REFERENCE=1`` or ``reference_mode()``)."""
    return _REFERENCE_MODE[0] > 0 or os.environ.get("LIGER_MODELS_REFERENCE", "0") not in ("", "0")


@contextlib.contextmanager
def reference_mode():
    """Within this block every kernel call runs its PyTorch reference (fusion off), on the GPU too."""
    _REFERENCE_MODE[0] += 1
    try:
        yield
    finally:
        _REFERENCE_MODE[0] -= 1


def opaque_to_compile(fn):
    """``torch.compiler.disable(fn)``, applied at the first call instead of at import: applying it imports
    torch._dynamo, about 1 s and most of this package's import time, which a process that never compiles (the CLI's
    start, each rank of a launch) need not pay. Inside a compiled region the call is one graph break, as with the
    decorator."""
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)
    return call


def interpreting() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether these tensors go through the Triton kernels rather than the PyTorch reference.

    All tensors must live on one device; mixing is a caller bug that would otherwise surface as an
    illegal memory access inside a kernel.
    """
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"tensors on different devices: {sorted(str(d) for d in devices)}")
    device = next(iter(devices))
    if reference_forced():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


def row_view(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as (rows, last_dim) with a unit last-dim stride, copying only when it must.

    Kernels take a row stride, so any layout whose last dim is contiguous and whose leading dims collapse
    into one stride is used in place (this covers slices of a fused projection output). A layout that does
    not collapse (e.g. a transposed view) costs one copy; callers must not rely on writes through it.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    # The row count spelled out: reshape(-1, 0) of a zero-width tensor is ambiguous and raises.
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def once_differentiable(backward):
    """Make a Function's backward refuse create_graph=True instead of returning gradients that are silently wrong.

    The backwards launch Triton kernels, which autograd cannot see: under create_graph=True their gradients would
    have no grad_fn, so differentiating them again would drop every second-order term (or fail later with an
    unrelated message). torch's ``once_differentiable`` guards only when the incoming gradient requires grad, yet
    these gradients depend on the saved inputs as well (d(rms_norm(x).sum())/dx still depends on x), and its error
    node is not connected to them. Autograd runs a backward with grad mode on exactly when create_graph=True, so
    that is checked here; a plain backward pays one flag read.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(f"{type(ctx).__name__.removesuffix('Backward')}: backward with create_graph=True "
                               "(double backward) is not supported; its gradients are not differentiable")
        return backward(ctx, *grads)

    return wrapper
