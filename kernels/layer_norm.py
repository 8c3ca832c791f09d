"""LayerNorm with optional bias.

Math, per row x of length N (statistics in fp32, one cast at the end, like torch.nn.functional.layer_norm):
  mean = Σx / N,  rstd = 1 / sqrt(Σ(x − mean)² / N + eps),  y = ((x − mean) · rstd · w + b).to(x.dtype)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """PyTorch LayerNorm with fp32 statistics and affine; output in x.dtype."""
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (any leading shape and strides); autograd-aware."""
    return layer_norm_reference(x, weight, bias, eps)


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
