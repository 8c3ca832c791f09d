"""Qwen2 / Qwen2.5: how it differs from Llama.

- q_proj, k_proj and v_proj always carry biases (o_proj and the MLP never do).
- Sliding window only when ``use_sliding_window`` is true, and then only in layers typed "sliding_attention"
  (default: layers ≥ ``max_window_layers``); Qwen2.5 ships it off, so attention is full causal.
- ≤3B checkpoints tie the head to the embedding (no lm_head.weight in the file)."""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import Qwen2Config


class LigerQwen2ForCausalLM(LigerForCausalLM):
    """HF `Qwen2ForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = Qwen2Config
