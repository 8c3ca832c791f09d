"""Gated MLP: down(act(gate(x)) * up(x)) with one gate|up GEMM feeding the fused SwiGLU / GeGLU kernel."""

from __future__ import annotations

import torch
from torch import nn

from liger_models.kernels.geglu import geglu_packed
from liger_models.kernels.swiglu import swiglu_packed

from .config import LigerConfig
from .linear import packed_linear


class GatedMLP(nn.Module):
    """HF names gate_proj / up_proj / down_proj (or Phi3's gate_up_proj, rows [gate | up])."""

    def __init__(self, config: LigerConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        if config.fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.activation = config.activation

    def packed_groups(self) -> list[list[nn.Linear]]:
        return [] if hasattr(self, "gate_up_proj") else [[self.gate_proj, self.up_proj]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate_up = self.gate_up_proj(x)
        else:
            gate_up = packed_linear(x, [self.gate_proj, self.up_proj])  # (..., 2I) = [gate | up]
        if self.activation == "silu":
            h = swiglu_packed(gate_up)
        else:
            h = geglu_packed(gate_up, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(h)
