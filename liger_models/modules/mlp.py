"""Gated MLP: down(act(gate(x)) * up(x)) with one gate|up GEMM; the SwiGLU / GeGLU product is recomputed in backward."""

from __future__ import annotations

import torch
from torch import nn

from .config import LigerConfig
from .fused import gated_down
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
        return [] if hasattr(self, "gate_up_proj") else [self.projections()]

    def projections(self) -> list[nn.Linear]:
        """The linears whose outputs, concatenated, are [gate | up] (one GEMM: ``packed_linear``)."""
        return [self.gate_up_proj] if hasattr(self, "gate_up_proj") else [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_gate_up(packed_linear(x, self.projections()))

    def from_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) from the packed (..., 2I) projection output; the product is not saved."""
        return gated_down(gate_up, self.activation, self.down_proj)
