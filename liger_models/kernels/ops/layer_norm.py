"""LayerNorm with optional bias.

Math, per row x of length N (statistics and affine in fp32, one cast at the end, like torch's layer_norm on
low-precision inputs):  mean = Σx / N,  rstd = 1 / sqrt(Σ(x − mean)² / N + eps),  x̂ = (x − mean) · rstd,
  y = (x̂ · w + b).to(x.dtype)
Backward, with g = dy · w:  dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)),  dW = Σ_rows dy · x̂,  dB = Σ_rows dy.

The Triton kernels are the CENTER variant of the row-norm kernels in rms_norm.py (same tiling, persistent
backward with fp32 dW/dB partials reduced deterministically, column-split rows above 8K/16K); the forward also
saves the per-row mean (fp32) next to rstd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._dispatch import once_differentiable, opaque_to_compile, use_triton
from .rms_norm import _rows, norm_backward, norm_forward, unit_stride


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """PyTorch LayerNorm with statistics and affine in fp32 (float64 stays float64); output in x.dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    b = None if bias is None else bias.to(acc)
    return F.layer_norm(x.to(acc), (x.shape[-1],), weight.to(acc), b, eps).to(x.dtype)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = _rows(x)
        y, _, mean, rstd = norm_forward(x2, None, weight, bias, eps, 0.0, center=True, gemma=True)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y if x.dim() == 2 else y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_backward(
            _rows(dy), x2, weight, mean, rstd, None, 0.0, center=True, gemma=True,
            need_dw=ctx.needs_input_grad[1], need_db=ctx.bias_dtype is not None and ctx.needs_input_grad[2],
            db_dtype=ctx.bias_dtype,
        )
        return dx if dy.dim() == 2 else dx.view(dy.shape), dw, db, None


@opaque_to_compile  # one clean graph break (dynamo cannot trace Triton launches)
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (any leading shape and strides); autograd-aware; output in x.dtype."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"layer_norm needs a floating-point input, got {x.dtype}")
    if not isinstance(weight, torch.Tensor):  # the kernels load it unconditionally (only the bias is optional)
        raise TypeError(f"layer_norm needs a weight tensor, got {type(weight).__name__}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"layer_norm needs a non-empty last dimension, got shape {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != x.shape[-1]):
            raise ValueError(f"{name} shape {tuple(p.shape)} does not match hidden size {x.shape[-1]}")
    if not use_triton(x, weight, bias):
        return layer_norm_reference(x, weight, bias, eps)
    return _LayerNormFunction.apply(x, unit_stride(weight), unit_stride(bias), float(eps))


class LayerNorm(nn.Module):
    """LayerNorm with parameters ``weight`` (ones) and ``bias`` (zeros, or None when bias=False)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
