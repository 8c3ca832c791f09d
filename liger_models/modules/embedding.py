"""The token embedding of the families that scale it (Gemma, Gemma 2, Gemma 3): E[ids] · √H inside the module.

transformers v5 scales inside the embedding module (``Gemma*TextScaledWordEmbedding``), so what the tools around a
model see at ``get_input_embeddings()`` is the scaled vector: a forward hook on it (HF Trainer's and TRL's NEFTune
noise, ``enable_input_require_grads``), ``inputs_embeds`` a caller builds from it (PEFT's prompt tuning prepends its
virtual tokens to them) and PEFT's adapters on it, which read ``embed_scale`` to scale their own output alike. Scaling
after the module instead, as transformers v4 did, gave all of those a different vector (NEFTune's noise √H times too
large; prompt-tuning adapters that do not carry over).

The scale is √H rounded to the table's dtype before the product, as transformers rounds its buffer (``embed_scale``
is a plain float here: nothing to save or load, nothing on the meta device).
"""

from __future__ import annotations

import torch
from torch import nn


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose output is multiplied by ``embed_scale``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 embed_scale: float = 1.0) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.embed_scale = float(embed_scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return scaled(super().forward(ids), self.embed_scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_scale={self.embed_scale:g}"


def scaled(x: torch.Tensor, embed_scale: float | None) -> torch.Tensor:
    """x · embed_scale, the scale rounded to x's dtype first (transformers' rounding); x itself for None. The scale
    is a 0-dim CPU tensor, which a CUDA product takes as a number: no host-to-device copy, which a CUDA graph being
    captured (graphed decoding) would refuse."""
    return x if embed_scale is None else x * torch.tensor(embed_scale, dtype=x.dtype)
