"""Mistral: how it differs from Llama.

- Sliding-window attention when ``sliding_window`` is set (v0.1: 4096; null from v0.2): a query sees exactly W keys
  including itself, in every layer.
- No bias flags: q, k, v, o and the MLP never have biases.
- HF defaults: 8 kv heads, intermediate 14336, max_position_embeddings 131072."""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import MistralConfig


class LigerMistralForCausalLM(LigerForCausalLM):
    """HF `MistralForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = MistralConfig
