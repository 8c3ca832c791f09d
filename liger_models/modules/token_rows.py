"""PEFT's trainable tokens: chosen rows of the embedding table (and of lm_head) that train in place of the frozen rows.

The common chat fine-tune that adds special tokens (or whose base never trained its template's tokens) needs those
tokens' rows to learn, and nothing else of the table. ``TokenRows`` holds the rows' values as
``trainable_tokens_delta`` [n, hidden] (PEFT's name, though it holds the rows themselves, not a difference) and the
token ids; it is the ``token_adapter`` submodule of the table whose rows it replaces (a LoraEmbedding, or lm_head's
LoraLinear), so its parameter's name is PEFT's key (``model.embed_tokens.token_adapter.trainable_tokens_delta``).

PEFT's forward is the table with those rows copied in (index_copy), then F.embedding / F.linear. Here:
  * embedding: the frozen table's lookup, then the rows of the chosen tokens taken from the trained values (before
    Gemma's √H scale, which PEFT applies to the copied table's output too). A chosen padding token's row gets no
    gradient, as F.embedding gives the padding row none;
  * lm_head inside the loss: logits = h·Wᵀ + u·Oᵀ with u = h·(R − W[ids])ᵀ [tokens, n] and O the one-hot [vocab, n]
    that puts u's column j at token ids[j]: the low-rank term the fused linear-cross-entropy takes for a LoRA head, so
    training the rows forms neither the logits nor a vocab × hidden weight, and only dR = duᵀ·h reaches the rows.
    Outside the loss the chosen columns of the logits are h·Rᵀ, PEFT's own product.
The rows are kept in the adapters' dtype (fp32 by default, so the optimizer updates them in full precision, where PEFT
keeps the table's dtype) and cast to the activations' dtype where they are used. ``merge_into`` copies them into the
table and ``unmerge_from`` puts the original rows back (kept, as PEFT keeps them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The rows' key under their table's name, PEFT's (``model.embed_tokens.`` + this).
ADAPTER_KEY = "token_adapter.trainable_tokens_delta"


class TokenRows(nn.Module):
    """Trained values for rows ``ids`` of a [vocab, hidden] table (see the module docstring)."""

    def __init__(self, table: torch.Tensor, ids: list[int], padding_idx: int | None = None,
                 dtype: torch.dtype = torch.float32, init: bool | str = True) -> None:
        super().__init__()
        vocab, hidden = table.shape
        if len(set(ids)) != len(ids) or not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"token rows must be distinct ids of the {vocab}-row table, got {ids}")
        index = torch.tensor(ids, dtype=torch.long, device=table.device)
        original = table.detach()[index].clone()
        # init=False draws the rows at random (a non-zero change, for tests), as PEFT's init_weights=False does.
        values = original.to(dtype) if init is not False else torch.randn(len(ids), hidden, dtype=dtype,
                                                                          device=table.device)
        self.trainable_tokens_delta = nn.Parameter(values)
        self.register_buffer("token_indices", index, persistent=False)
        self.register_buffer("trainable_tokens_original", original, persistent=False)
        slot = torch.full((vocab,), -1, dtype=torch.long, device=table.device)
        slot[index] = torch.arange(len(ids), device=table.device)
        self.register_buffer("slot_of_token", slot, persistent=False)  # token id → its row here, or -1
        # F.embedding's padding_idx on the rows: the padding token's row, when chosen, takes no gradient.
        self.padding_slot = ids.index(padding_idx) if padding_idx in ids else None
        self.merged = False

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        """Key suffix (under the table's name) → the rows' Parameter, as the tables' adapter_tensors give theirs."""
        return {ADAPTER_KEY: self.trainable_tokens_delta}

    @property
    def ids(self) -> list[int]:
        return self.token_indices.tolist()

    def looked_up(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """``embedded`` (the frozen table's lookup of ``ids``) with the chosen tokens' vectors from these rows."""
        slot = self.slot_of_token[ids]
        rows = F.embedding(slot.clamp(min=0), self.trainable_tokens_delta.to(embedded.dtype), self.padding_slot)
        return torch.where((slot >= 0).unsqueeze(-1), rows, embedded)

    def with_columns(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` = x·Wᵀ with the chosen tokens' columns computed from these rows instead (x·Rᵀ)."""
        columns = F.linear(x, self.trainable_tokens_delta.to(x.dtype)).to(logits.dtype)
        return logits.index_copy(-1, self.token_indices, columns)

    def low_rank_terms(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, O) with x·Wᵀ + u·Oᵀ the logits of W with these rows (the module docstring), in x's dtype; the
        difference R − W[ids] is formed in fp32 and rounded once."""
        index = self.token_indices
        difference = self.trainable_tokens_delta.float() - weight.detach()[index].float()
        u = F.linear(x, difference.to(x.dtype))
        one_hot = torch.zeros(weight.shape[0], len(index), dtype=u.dtype, device=u.device)
        one_hot[index, torch.arange(len(index), device=u.device)] = 1
        return u, one_hot

    def applied_to(self, table: torch.Tensor) -> torch.Tensor:
        """A copy of ``table`` with these rows in it (in the table's dtype), differentiable in the rows where grad is
        enabled (the merges call it under no_grad; TRL's fused LM head trains through it)."""
        return table.index_copy(0, self.token_indices.to(table.device), self.trainable_tokens_delta.to(table))

    @torch.no_grad()
    def merge_into(self, table: torch.Tensor) -> None:
        if not self.merged:
            table.index_copy_(0, self.token_indices, self.trainable_tokens_delta.to(table.dtype))
            self.merged = True

    @torch.no_grad()
    def unmerge_from(self, table: torch.Tensor) -> None:
        if self.merged:
            table.index_copy_(0, self.token_indices, self.trainable_tokens_original.to(table.dtype))
            self.merged = False

    def extra_repr(self) -> str:
        return f"tokens={len(self.token_indices)}{', merged' if self.merged else ''}"
