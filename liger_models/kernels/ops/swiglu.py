"""SwiGLU: silu(gate) * up, for Llama / Mistral / Qwen2 / Phi3 MLPs. The kernels live in gated_mlp.py."""

from __future__ import annotations

import torch

from .gated_mlp import gated_mlp, gated_mlp_packed, gated_mlp_reference


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the input dtype."""
    return gated_mlp_reference(gate, up, "silu")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up of shape (..., I) (strided views read in place); autograd-aware."""
    return gated_mlp(gate, up, "silu")


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused (..., 2I) = [gate | up] projection output; d(gate_up) comes back as one tensor."""
    return gated_mlp_packed(gate_up, "silu")
