"""Mixtral: how it differs from Llama.

- Every layer's MLP is a sparse mixture of ``num_local_experts`` SwiGLU experts (each of ``intermediate_size``)
  behind a bias-free router ``block_sparse_moe.gate`` (E, D): softmax over all E logits in fp32, top
  ``num_experts_per_tok``, the chosen probabilities renormalised to sum to 1 and kept fp32 (transformers v5; v4 cast
  them to the activation dtype first, a bf16-only difference); output Σ_j w_j · expert_j(x), cast once. No token
  dropping. Experts on disk: ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down).
- ``router_jitter_noise`` > 0, in training only, multiplies the MLP input by U(1−ε, 1+ε) before routing (the
  experts see it too).
- ``output_router_logits``: the auxiliary load-balancing loss, added to the loss × ``router_aux_loss_coef`` (0.02
  in Mixtral-8x7B's config.json, 0.001 when absent).
- Attention is Mistral's: no biases, a non-null ``sliding_window`` applies to every layer (null in 8x7B / 8x22B).
- Defaults when absent: rope_theta 1e6, rms_norm_eps 1e-5, 8 kv heads, 8 experts, top-2."""

from __future__ import annotations

from liger_models.modules.moe_causal_lm import LigerMoeForCausalLM

from .config import MixtralConfig


class LigerMixtralForCausalLM(LigerMoeForCausalLM):
    """HF `MixtralForCausalLM` with fused kernels and grouped expert GEMMs; loads and saves the same safetensors
    checkpoints."""

    config_class = MixtralConfig
