"""RMSNorm and fused residual-add + RMSNorm.

Math, per row x of length N:  rstd = 1 / sqrt(mean(x²) + eps)
  casting="llama" (HF LlamaRMSNorm; Mistral, Qwen2, Phi3):  y = w · (x_f32 · rstd).to(x.dtype)
  casting="gemma" (HF GemmaRMSNorm):                        y = (x_f32 · rstd · (offset + w_f32)).to(x.dtype)
The output is in x.dtype (HF promotes w.dtype with x.dtype in llama mode; with both in one dtype it is that dtype).

add_rms_norm: r = x + residual (in x.dtype, like HF's `h = h + a`), y = rms_norm(r); returns (y, r).
"""

from __future__ import annotations

import torch
from torch import nn

from ._dispatch import use_triton

_CASTINGS = ("llama", "gemma")


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """PyTorch RMSNorm in HF's numeric order (see the module docstring); output in x.dtype."""
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "llama":
        w = weight + offset if offset else weight
        return (w * xn.to(x.dtype)).to(x.dtype)
    return (xn * (offset + weight.float())).to(x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, casting: str) -> None:
    if casting not in _CASTINGS:
        raise ValueError(f"casting must be one of {_CASTINGS}, got {casting!r}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape and strides); autograd-aware."""
    _check(x, weight, casting)
    return rms_norm_reference(x, weight, eps, offset, casting)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual; return rms_norm(r), r`` in one pass; gradients reach both x and residual."""
    _check(x, weight, casting)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    r = x + residual.to(x.dtype)
    return rms_norm_reference(r, weight, eps, offset, casting), r


class RMSNorm(nn.Module):
    """RMSNorm with HF parameter name ``weight`` (ones for llama casting, zeros for gemma's offset form)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting: str = "llama",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if casting not in _CASTINGS:
            raise ValueError(f"casting must be one of {_CASTINGS}, got {casting!r}")
        init = torch.zeros if casting == "gemma" else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps, self.offset, self.casting = eps, offset, casting

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, offset=self.offset, casting=self.casting)
        return add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}"
