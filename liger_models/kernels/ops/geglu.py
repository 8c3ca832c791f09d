"""GeGLU: gelu(gate) * up, for Gemma MLPs (tanh approximation, or exact erf). The kernels live in gated_mlp.py."""

from __future__ import annotations

import torch

from .gated_mlp import gated_mlp, gated_mlp_packed, gated_mlp_reference


def _activation(approximate: str) -> str:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up in fp32, rounded once to the input dtype."""
    return gated_mlp_reference(gate, up, _activation(approximate))


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up for gate, up of shape (..., I) (strided views read in place); autograd-aware."""
    return gated_mlp(gate, up, _activation(approximate))


def geglu_packed(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up from the fused (..., 2I) = [gate | up] projection output; d(gate_up) comes back as one tensor."""
    return gated_mlp_packed(gate_up, _activation(approximate))
