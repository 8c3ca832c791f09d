"""LoRA on the token embedding table, PEFT's definition: e = E[ids] + s · A[:, ids]ᵀ · Bᵀ.

``LoraEmbedding`` replaces ``embed_tokens`` under the same name and keeps its ``weight`` Parameter (so a tied lm_head
still reads the same table). The adapter is ``lora_embedding_A`` [r, vocab] and ``lora_embedding_B`` [hidden, r],
PEFT's shapes and key names; PEFT starts A at zero and B normal (the reverse of a linear's adapter), applies no
dropout to an embedding's adapter, and scales the delta by the table's embedding scale as the table's own output is
scaled (Gemma's √H multiplies both; modules/embedding.py), as PEFT does with transformers' scaled embeddings. The
delta is computed in the adapter's dtype and the sum rounded once to the table's dtype, as PEFT's sum of a bf16
lookup and an fp32 delta is. The lookup of A skips the padding row's gradient as the base table's does.

Instead of an adapter, a table may carry trainable-token rows (PEFT's trainable_token_indices; modules/token_rows.py)
as its ``token_adapter``: the chosen tokens' vectors are those rows, before the embedding scale. PEFT puts one or the
other on a table, never both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .embedding import ScaledEmbedding, scaled
from .lora_linear import check_rank
from .token_rows import TokenRows


class LoraEmbedding(nn.Module):
    """A frozen embedding table and at most one LoRA adapter (see the module docstring)."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None = None,
                 embed_scale: float | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.embed_scale = embed_scale  # the wrapped ScaledEmbedding's, or None
        self.weight = weight
        self.lora_embedding_A: nn.Parameter | None = None
        self.lora_embedding_B: nn.Parameter | None = None
        self.r, self.lora_alpha, self.scaling = 0, 0.0, 0.0
        self.token_adapter: TokenRows | None = None
        self.merged = False

    @classmethod
    def from_embedding(cls, embedding: nn.Module) -> "LoraEmbedding":
        if isinstance(embedding, LoraEmbedding):
            return embedding
        if type(embedding) not in (nn.Embedding, ScaledEmbedding):
            raise TypeError(f"LoRA attaches to an nn.Embedding table, got {type(embedding).__name__}")
        for option in ("max_norm", "sparse", "scale_grad_by_freq"):
            if getattr(embedding, option):
                raise ValueError(f"LoRA on an embedding with {option} set is not supported")
        return cls(embedding.weight, embedding.padding_idx, getattr(embedding, "embed_scale", None))

    @property
    def has_adapter(self) -> bool:
        return self.lora_embedding_A is not None and not self.merged

    @property
    def carries_adapter(self) -> bool:
        """An adapter or trainable-token rows are attached, merged into the table or not."""
        return self.lora_embedding_A is not None or self.token_adapter is not None

    def add_token_rows(self, ids: list[int], dtype: torch.dtype = torch.float32, init: bool | str = True) -> None:
        """Trainable rows for tokens ``ids``, starting at their current values (see modules/token_rows.py)."""
        if self.lora_embedding_A is not None:
            raise ValueError("a table takes a LoRA adapter or trainable-token rows, not both (as PEFT)")
        self.token_adapter = TokenRows(self.weight, ids, self.padding_idx, dtype, init)

    use_dora = False  # PEFT's DoRA on embeddings is not offered here (refused in liger_models.lora)

    def add_adapter(self, r: int, alpha: float, use_rslora: bool = False, init: str | bool = True,
                    dtype: torch.dtype = torch.float32) -> None:
        """A = 0 and B ~ N(0, 1) (PEFT's embedding init, also for "gaussian"); init=False draws A too (a non-zero
        adapter, for tests)."""
        check_rank(r)
        device = self.weight.device
        a = torch.zeros(r, self.num_embeddings, device=device, dtype=dtype)
        if init is False:
            nn.init.normal_(a, std=1 / math.sqrt(r))
        self.lora_embedding_A = nn.Parameter(a)
        self.lora_embedding_B = nn.Parameter(torch.randn(self.embedding_dim, r, device=device, dtype=dtype))
        self.r, self.lora_alpha = r, float(alpha)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        """Key suffix → Parameter of what the adapter trains, under PEFT's names."""
        if self.token_adapter is not None:
            return self.token_adapter.adapter_tensors()
        return {"lora_embedding_A": self.lora_embedding_A, "lora_embedding_B": self.lora_embedding_B}

    def delta_weight(self) -> torch.Tensor:
        """s·(B·A)ᵀ [vocab, hidden] in fp32."""
        return self.scaling * (self.lora_embedding_A.float().t() @ self.lora_embedding_B.float().t())

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The table with the adapter in it, fp32: E + s·(B·A)ᵀ, or E with the trained token rows."""
        if self.token_adapter is not None:
            return self.token_adapter.applied_to(self.weight.float())
        return self.weight.float() + self.delta_weight()

    @torch.no_grad()
    def merge(self) -> None:
        """E += s·(B·A)ᵀ (fp32, rounded once), or the token rows copied in; the adapter then adds nothing until
        ``unmerge``."""
        if self.merged:
            return
        if self.token_adapter is not None:
            self.token_adapter.merge_into(self.weight)
        elif self.lora_embedding_A is not None:
            self.weight.copy_(self.merged_weight())
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        if self.token_adapter is not None:
            self.token_adapter.unmerge_from(self.weight)
        elif self.lora_embedding_A is not None:
            self.weight.copy_(self.weight.float() - self.delta_weight())
        self.merged = False

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, r={self.r}, "
                f"scaling={self.scaling:g}{', merged' if self.merged else ''}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        base = F.embedding(ids, self.weight, self.padding_idx)
        if self.has_adapter:
            after_a = F.embedding(ids, self.lora_embedding_A.t(), self.padding_idx)
            base = (base + (after_a @ self.lora_embedding_B.t()) * self.scaling).to(base.dtype)
        elif self.token_adapter is not None and not self.merged:
            base = self.token_adapter.looked_up(ids, base)
        return scaled(base, self.embed_scale)
