"""The causal-LM wrapper every family shares: LM head, fused linear-cross-entropy loss, logits, I/O entry points.

Training: ``model(input_ids, labels=...)`` shifts labels inside (HF convention: labels aligned with inputs, -100
ignored; a packed-document boundary is never a target) and computes the loss with ``fused_linear_cross_entropy``
straight from the final hidden states, so the B·T×V logits never exist. Inference returns logits (all positions or
the last ``num_logits_to_keep``) in the activation dtype, optionally with a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from liger_models.kernels.cross_entropy import cross_entropy
from liger_models.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

from .cache import KVCache
from .config import LigerConfig
from .decoder import DecoderModel
from .generate import generate
from .linear import is_plain_linear, pack_linears_
from .loss import autocast_operands, shift_labels
from .output import model_output


@model_output
@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: KVCache | None = None


def keep_positions(hidden: torch.Tensor, num_logits_to_keep: int, logits_to_keep: int | torch.Tensor | None):
    """The positions whose logits are wanted: all (0), the last k (int), or the given indices (tensor)."""
    if logits_to_keep is None:
        logits_to_keep = num_logits_to_keep
    elif num_logits_to_keep:
        raise ValueError("pass num_logits_to_keep or logits_to_keep (HF v5's name for it), not both")
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep]
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


class LigerForCausalLM(nn.Module):
    """Decoder (``.model``) + LM head (``.lm_head``, tied to the embedding when the config says so)."""

    config_class: ClassVar[type[LigerConfig]] = LigerConfig

    def __init__(self, config: LigerConfig) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        # The checkpoint's generation_config.json ({} if none; from_pretrained fills it, save_pretrained writes it
        # back): generate takes its eos / pad ids from here before config.json's, as HF does.
        self.generation_config: dict = {}
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF init: normal(0, initializer_range) weights, zero biases and padding row; norms keep their own init."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if getattr(module, "padding_idx", None) is not None:
                    module.weight[module.padding_idx].zero_()
        self.pack_()

    def pack_(self) -> "LigerForCausalLM":
        """Lay q|k|v and gate|up weights back to back so each runs as one GEMM (see modules/linear.py)."""
        for module in self.modules():
            for group in getattr(module, "packed_groups", lambda: [])():
                pack_linears_(group)
        return self

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half() move each parameter on its own; lay the fused groups out again afterwards.
        super()._apply(fn, recurse)
        return self.pack_()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, normalizer: float | torch.Tensor | None = None,
                num_logits_to_keep: int = 0, past_key_values: KVCache | None = None,
                use_cache: bool = False, attention_mask: torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor | None = None) -> CausalLMOutput:
        """Loss (with labels; logits None) or logits (B, T or num_logits_to_keep, V); see the module docstring.

        attention_mask: HF's (B, past + T) 0/1 mask; padded keys are hidden. As in HF, position_ids still default
        to past..past+T−1 (pass cumsum-based ones for left padding, as ``generate`` does), and labels at padding
        should be -100. logits_to_keep is HF v5's name for num_logits_to_keep; it also takes a tensor of positions.
        """
        if use_cache and past_key_values is None:
            past_key_values = KVCache()
        hidden = self.model(input_ids, position_ids, cache=past_key_values, attention_mask=attention_mask)
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
            targets = shift_labels(labels, 1, position_ids)  # (B, T)
            if not is_plain_linear(self.lm_head):
                # A wrapped head (PEFT's LoRA on lm_head) computes more than hidden · Wᵀ: its logits are formed.
                loss = cross_entropy(self.lm_head(hidden), targets, normalizer=normalizer)
                return CausalLMOutput(loss=loss, past_key_values=past_key_values)
            hidden, weight = autocast_operands(hidden, self.lm_head.weight)
            loss = fused_linear_cross_entropy(hidden, weight, targets, normalizer=normalizer)
            return CausalLMOutput(loss=loss, past_key_values=past_key_values)
        hidden = keep_positions(hidden, num_logits_to_keep, logits_to_keep)
        return CausalLMOutput(logits=self.lm_head(hidden), past_key_values=past_key_values)

    generate = generate

    # ---- checkpoints (implemented in liger_models.hub) ------------------------------------------------------
    @classmethod
    def from_config(cls, config: LigerConfig, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> "LigerForCausalLM":
        """A randomly initialised model (HF init) in ``dtype`` on ``device``."""
        with torch.device("cpu" if device is None else device):  # not `device or`: device 0 is cuda:0
            model = cls(config)
        return model.to(dtype) if dtype is not None else model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | int | None = None) -> "LigerForCausalLM":
        """Load an HF-format directory (config.json + safetensors); dtype (None or "auto") defaults to the config's,
        else the checkpoint's."""
        from liger_models.hub import load_pretrained

        return load_pretrained(path, cls, dtype=dtype, device=device)

    @classmethod
    def from_hub(cls, repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None,
                 local_files_only: bool = False, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | int | None = None,
                 token: str | bool | None = None) -> "LigerForCausalLM":
        """Download (or find in the HF cache) *.json, *.safetensors and tokenizer files, then ``from_pretrained``;
        ``token`` (else HF_TOKEN / the stored login) for gated repos."""
        from liger_models.hub import snapshot

        path = snapshot(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                        token=token)
        return cls.from_pretrained(path, dtype=dtype, device=device)

    def save_pretrained(self, directory: str | Path, max_shard_size: int | str = "5GB", *,
                        safe_serialization: bool = True) -> None:
        """Write HF-format safetensors (+ index when sharded) and config.json, atomically. safe_serialization is
        accepted as transformers' callers pass it; only safetensors are written."""
        from liger_models.hub import save_pretrained

        if not safe_serialization:
            raise ValueError("save_pretrained writes safetensors only (safe_serialization=False asks for "
                             "pytorch_model.bin, which this library does not write)")
        save_pretrained(self, directory, max_shard_size=max_shard_size)
