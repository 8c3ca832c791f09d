"""Medusa heads: K × (ResBlock × L → vocab projection) on the base model's final hidden states.

Head k: z = ResBlock_L(… ResBlock_1(h)), ResBlock(x) = x + SiLU(W x + b), then logits_k = W2_k z.
W is zero-initialised and b keeps nn.Linear's default U(-1/√H, 1/√H) init, as in FasterDecoding/Medusa, so a fresh
block is x + SiLU(b): close to, not exactly, the identity. Each layer owns its weights (upstream's
`[ResBlock(H)] * n` shares one module between layers; we do not reproduce that bug). W2_k is either the head's own
V×H matrix, copied from the base `lm_head` at init, or — `share_lm_head` (Medusa "version 2") — the base `lm_head`
itself, which the heads never train.

The state_dict speaks the Medusa/TGI key format: `{h}.{l}.linear.weight|bias` and, when not shared, `{h}.{L}.weight`.
With L == 1 the K first-layer GEMMs run as one H → K·H GEMM (TGI's MedusaHeadV2 layout), which reads h once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from liger_models.medusa.config import MedusaConfig


class ResBlock(nn.Module):
    """x + SiLU(W x + b) with W zero-initialised (bias: PyTorch default init)."""

    def __init__(self, hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=True, device=device, dtype=dtype)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """K Medusa heads; `forward(h)` gives each head's ResBlock output, `weight(k)` its vocab projection.

    base_lm_head: the base model's `lm_head` (nn.Linear V×H, no bias). Copied into every head when
    `config.share_lm_head` is False (may then be omitted for a fresh, randomly initialised projection, e.g. before
    loading a checkpoint); required when it is True, and then kept as a reference that is not registered as a
    submodule, so it appears in neither `state_dict()` nor `parameters()`.
    """

    def __init__(self, config: MedusaConfig, base_lm_head: nn.Linear | None = None, *, device=None, dtype=None):
        super().__init__()
        if config.hidden_size <= 0 or config.vocab_size <= 0:
            raise ValueError("MedusaConfig.hidden_size and vocab_size must be set (use MedusaConfig.for_base(base))")
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        if base_lm_head is not None:
            if tuple(base_lm_head.weight.shape) != (V, H):
                raise ValueError(f"base lm_head weight is {tuple(base_lm_head.weight.shape)}, config expects {(V, H)}")
            if getattr(base_lm_head, "bias", None) is not None:
                raise ValueError("Medusa heads expect a bias-free base lm_head")
            device = device or base_lm_head.weight.device
            dtype = dtype or base_lm_head.weight.dtype
        elif config.share_lm_head:
            raise ValueError("share_lm_head=True needs the base model's lm_head")
        # A tuple hides the shared head from Module registration (no state_dict keys, no parameters()).
        self._shared = (base_lm_head,) if config.share_lm_head else ()
        for _ in range(config.num_heads):
            layers: list[nn.Module] = [ResBlock(H, device=device, dtype=dtype) for _ in range(config.num_layers)]
            if not config.share_lm_head:
                proj = nn.Linear(H, V, bias=False, device=device, dtype=dtype)
                if base_lm_head is not None:
                    with torch.no_grad():
                        proj.weight.copy_(base_lm_head.weight)
                layers.append(proj)
            # A ModuleList of Sequentials is what makes the keys `{h}.{l}.linear.*` and `{h}.{L}.weight`.
            self.append(nn.Sequential(*layers))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def resblocks(self, k: int) -> list[ResBlock]:
        """Head k's (0-based) ResBlocks, in order."""
        return [self[k][l] for l in range(self.config.num_layers)]

    def weight(self, k: int) -> torch.Tensor:
        """Head k's V×H vocab projection; the shared base lm_head weight is returned detached (never trained here)."""
        if self.config.share_lm_head:
            return self._shared[0].weight.detach()
        return self[k][self.config.num_layers].weight

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """ResBlock outputs z_k (each shaped like `hidden`) for k = 0..K-1; no logits are formed."""
        K, L, H = self.config.num_heads, self.config.num_layers, self.config.hidden_size
        if hidden.shape[-1] != H:
            raise ValueError(f"hidden states have size {hidden.shape[-1]}, Medusa heads expect {H}")
        if L == 0:
            return [hidden] * K
        if L == 1 and K > 1:
            # One H → K·H GEMM for every head's first layer. The cat copies K·H² weights per call, small next to
            # the K separate passes over a B·T×H activation it replaces.
            w = torch.cat([self.resblocks(k)[0].linear.weight for k in range(K)])  # (K·H, H)
            b = torch.cat([self.resblocks(k)[0].linear.bias for k in range(K)])  # (K·H,)
            y = F.linear(hidden, w, b)  # (..., K·H)
            return [hidden + F.silu(y[..., k * H:(k + 1) * H]) for k in range(K)]
        outs = []
        for k in range(K):
            z = hidden
            for block in self.resblocks(k):
                z = block(z)
            outs.append(z)
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(K, ..., V) logits of every head — for decoding a few positions, never for training."""
        return torch.stack([F.linear(z, self.weight(k)) for k, z in enumerate(self(hidden))])
