"""Llama (2, 3, 3.1, 3.2): the reference family; every other family is stated as a difference from it.

Decoder of modules/: embed → [fused add+RMSNorm → attention (one q|k|v GEMM, fused RoPE, SDPA) → fused add+RMSNorm
→ one gate|up GEMM → fused SwiGLU → down] × L → final fused add+RMSNorm → LM head / fused linear-CE loss.
Config-driven variants: GQA, explicit head_dim, attention_bias (q, k, v, o) and mlp_bias, tied head (3.2-1B/3B),
RoPE default / linear / dynamic / llama3 (3.1, 3.2)."""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import LlamaConfig


class LigerLlamaForCausalLM(LigerForCausalLM):
    """HF `LlamaForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = LlamaConfig
