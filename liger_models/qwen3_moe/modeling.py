"""Qwen3-MoE: how it differs from Llama.

- Attention is Qwen3's: per-head q/k RMSNorm (Llama numerics) before RoPE, ``attention_bias`` for q/k/v/o (false in
  releases), head_dim from the field (128 on the Hub) else hidden / heads.
- MLP slot: sparse layers (i ∉ ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0) route to
  ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` through a bias-free router ``mlp.gate`` (E, D): softmax
  in fp32 over all E logits, top ``num_experts_per_tok``, renormalised only when ``norm_topk_prob`` (false by
  default, true in Qwen3-30B-A3B / 235B), then cast to the activation dtype; output Σ_j w_j · expert_j(x). No shared
  expert, no router bias, no token dropping. Other layers: a dense SwiGLU of ``intermediate_size``. Experts on disk:
  ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``.
- ``output_router_logits``: the auxiliary load-balancing loss, added × ``router_aux_loss_coef`` (0.001).
- Sliding window: when ``use_sliding_window`` is true, every layer uses ``sliding_window`` (released: off).
- Defaults when absent: vocab 151936, 128 experts, top-8, rope_theta 1e4 (1e6 on the Hub), eps 1e-6, untied."""

from __future__ import annotations

from liger_models.modules.moe_causal_lm import LigerMoeForCausalLM

from .config import Qwen3MoeConfig


class LigerQwen3MoeForCausalLM(LigerMoeForCausalLM):
    """HF `Qwen3MoeForCausalLM` with fused kernels and grouped expert GEMMs; loads and saves the same safetensors
    checkpoints."""

    config_class = Qwen3MoeConfig
