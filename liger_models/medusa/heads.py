"""Medusa heads: K × (ResBlock × L → vocab projection) on the base model's final hidden states.

Head k: z = ResBlock_L(… ResBlock_1(h)), ResBlock(x) = x + SiLU(W x + b), then logits_k = W2_k z.
W is zero-initialised and b keeps nn.Linear's default U(-1/√H, 1/√H) init, as in FasterDecoding/Medusa, so a fresh
block is x + SiLU(b): close to, not exactly, the identity. Each layer owns its weights (upstream's
`[ResBlock(H)] * n` shares one module between layers; we do not reproduce that bug). W2_k is either the head's own
V×H matrix, copied from the base `lm_head` at init, or — `share_lm_head` (Medusa "version 2") — the base `lm_head`
itself, which the heads never train.

The state_dict speaks the Medusa/TGI key format: `{h}.{l}.linear.weight|bias` and, when not shared, `{h}.{L}.weight`.
Training and logits run each head as one module call (`MedusaHeads.run`), everything that needs its weights inside
it, so FSDP2 can shard every head as its own unit: gathered only while that head runs (forward, then backward), its
gradients reduce-scattered as soon as its backward is done, instead of K heads' V×H projections held whole for the
step in the root group. (So the K first-layer GEMMs are K GEMMs, not TGI's one H → K·H GEMM: the same FLOPs, and at
8B width each is still 8K×4096×4096.)
"""

from __future__ import annotations

from typing import Any, Callable

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
        # Heads may be kept in another dtype than the base (fp32 heads on a bf16 base): the block runs in its own.
        x = x.to(self.linear.weight.dtype)
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Sequential):
    """One head: ResBlock × L, then its own V×H projection unless the lm_head is shared. An nn.Sequential, so the
    state_dict keys are Medusa's `{l}.linear.*` and `{L}.weight`."""

    def forward(self, hidden: torch.Tensor, project: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                shared_weight: torch.Tensor | None = None) -> Any:
        """z = the ResBlocks on `hidden`; without `project`, z itself, else `project(z, W2)` with W2 this head's
        projection weight (or `shared_weight`, the base lm_head's) — e.g. its linear-CE loss or its logits."""
        z = hidden
        for block in self:
            if isinstance(block, ResBlock):
                z = block(z)
        if project is None:
            return z
        weight = shared_weight if shared_weight is not None else self[-1].weight
        # z meets W in W's dtype: a GEMM (and the fused linear-CE) needs one dtype, and the shared base lm_head (or,
        # with no ResBlocks, the hidden states) may differ from the heads' own dtype. A no-op when they agree.
        return project(z.to(weight.dtype), weight)


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
            device = base_lm_head.weight.device if device is None else device
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
            self.append(MedusaHead(*layers))

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def resblocks(self, k: int) -> list[ResBlock]:
        """Head k's (0-based) ResBlocks, in order."""
        return [self[k][l] for l in range(self.config.num_layers)]

    def weight(self, k: int) -> torch.Tensor:
        """Head k's V×H vocab projection; the shared base lm_head weight is returned detached (never trained here)."""
        return self._shared_weight() if self.config.share_lm_head else self[k][self.config.num_layers].weight

    def _shared_weight(self) -> torch.Tensor | None:
        """The base lm_head weight, detached (the heads never train it); None when each head owns its projection."""
        return self._shared[0].weight.detach() if self.config.share_lm_head else None

    def run(self, k: int, hidden: torch.Tensor, project: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        """Head k (0-based) on `hidden` as one module call: `project(z_k, W2_k)` (see `MedusaHead.forward`)."""
        self._check_width(hidden)
        return self[k](hidden, project, self._shared_weight())

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """ResBlock outputs z_k (each shaped like `hidden`) for k = 0..K-1; no logits are formed."""
        self._check_width(hidden)
        return [self[k](hidden) for k in range(self.num_heads)]

    def _check_width(self, hidden: torch.Tensor) -> None:
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden states have size {hidden.shape[-1]}, "
                             f"Medusa heads expect {self.config.hidden_size}")

    def logits(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """(K, ..., V) logits of the first `num_heads` heads (default all) — for decoding a few positions, never for
        training. With the shared lm_head the heads' ResBlock outputs meet it in one GEMM: a decoding step reads the
        V×H weight once, not once per head (at 8B width 1 GiB each)."""
        heads = range(self.num_heads if num_heads is None else num_heads)
        shared = self._shared_weight()
        if shared is None:
            return torch.stack([self.run(k, hidden, F.linear) for k in heads])
        self._check_width(hidden)
        return F.linear(torch.stack([self[k](hidden) for k in heads]).to(shared.dtype), shared)


def base_logits(base: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The base model's logits at hidden: its ``compute_logits`` (lm_head plus the final soft-cap of Gemma 2) when
    it has one, else its lm_head (any base with ``.model`` and ``.lm_head`` serves)."""
    compute = getattr(base, "compute_logits", None)
    return compute(hidden) if compute is not None else base.lm_head(hidden)
