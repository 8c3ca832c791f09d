"""The tile product the kernels with a ``tl.dot`` share, and when its operands must be widened first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import interpreting


@triton.jit
def dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32 (fp64 for fp64). IEEE: fp32 operands multiplied exactly, not as TF32. UPCAST:
    multiply in fp32 instead, for Triton 3.6's interpreter, whose bf16 tl.dot returns garbage; bf16 products are
    exact in fp32, so the values are the same."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


def dot_flags(dtype: torch.dtype) -> dict:
    """The IEEE and UPCAST constexprs of ``dot`` for operands of ``dtype``."""
    return dict(IEEE=dtype == torch.float32, UPCAST=interpreting() and dtype.itemsize < 4)
