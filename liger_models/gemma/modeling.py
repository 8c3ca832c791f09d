"""Gemma (v1): how it differs from Llama.

- RMSNorm is (1 + w) computed in fp32 with a single final cast (weights stored as the offset, zeros at init).
- Embeddings are multiplied by √hidden_size rounded to the activation dtype first (bf16: 55.5 for 3072).
- GeGLU with tanh-approximated GELU (config "gelu" is read as tanh for this family; ``hidden_activation`` wins).
- head_dim 256 independent of hidden / heads; Gemma-2B is multi-query (1 kv head); the head is always tied."""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import GemmaConfig


class LigerGemmaForCausalLM(LigerForCausalLM):
    """HF `GemmaForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = GemmaConfig
