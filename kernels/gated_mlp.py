"""Gated MLP activation: out = act(gate) * up (SwiGLU with act = SiLU, GeGLU with act = GELU).

Math, with x = gate and u = up, all in fp32 and rounded once to the activation dtype:
  silu       a(x) = x·σ(x)
  gelu_tanh  a(x) = 0.5·x·(1 + tanh(z)) = x·σ(2z),  z = √(2/π)·(x + 0.044715·x³)
  gelu       a(x) = 0.5·x·(1 + erf(x/√2))           (exact, erf)
  out = a(x)·u;   d gate = dout·u·a'(x);   d up = dout·a(x)

HF numerics: `down(act(gate) * up)` runs the activation in the activation dtype (rounded once) and the
product in that dtype (rounded again). Here both happen in fp32 with a single rounding, so bf16 results sit
closer to the float64 reference than HF's own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def gated_mlp_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up in fp32 (float64 for float64 inputs), rounded once to gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    x, u = gate.to(compute), up.to(compute)
    if activation == "silu":
        a = F.silu(x)
    elif activation == "gelu_tanh":
        a = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    elif activation == "gelu":
        a = 0.5 * x * (1.0 + torch.erf(x * math.sqrt(0.5)))
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return (a * u).to(gate.dtype)


def _check(gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype or not gate.dtype.is_floating_point:
        raise TypeError(f"gate and up must share one floating dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up are on different devices: {gate.device} and {up.device}")


def gated_mlp(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate, up of shape (..., I); strided views are read in place."""
    _check(gate, up, activation)
    return gated_mlp_reference(gate, up, activation)


def gated_mlp_packed(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up where gate_up is (..., 2I) = [gate | up] along the last dim (fused gate_up projection)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even ([gate | up]), got {gate_up.shape[-1]}")
    half = gate_up.shape[-1] // 2
    return gated_mlp(gate_up[..., :half], gate_up[..., half:], activation)
