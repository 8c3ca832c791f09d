"""Phi3 (mini 4k / 128k, 3.5-mini): how it differs from Llama.

- Fused tensors: ``self_attn.qkv_proj`` (rows Q | K | V, split by head counts, never chunk(3)) and
  ``mlp.gate_up_proj`` (rows gate | up); no biases anywhere; RMSNorm eps 1e-5.
- RoPE longrope (128k / 3.5; type "su" or "yarn" read as longrope): short or long factors chosen per call from
  max(position_ids) + 1 > original_max_position_embeddings (top-level key), cos/sin always scaled by the attention
  factor; generation recomputes the cache when it crosses that length, like HF.
- Sliding window when ``sliding_window`` is set (Phi-3-mini-4k: 2047), exactly W keys including the query.
- partial_rotary_factor rotates only the first head_dim · factor dims of each head."""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import Phi3Config


class LigerPhi3ForCausalLM(LigerForCausalLM):
    """HF `Phi3ForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = Phi3Config
