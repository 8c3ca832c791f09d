"""Qwen3 (dense): how it differs from Llama.

- q_norm / k_norm: an RMSNorm over head_dim per head (Llama numerics: normalise in fp32, cast, then × w; eps
  ``rms_norm_eps``) on q and k after the projection and before RoPE; k is cached normed and rotated; v is not normed.
- head_dim is its own field (128 in every release; HF's default even when hidden / heads differs), and the
  attention scale is head_dim^-0.5.
- ``attention_bias`` (false in releases) gives q, k, v and o biases together; the MLP never has one.
- Sliding window as Qwen2: only when ``use_sliding_window`` is true, and then only in layers typed
  "sliding_attention" in ``layer_types`` (by default layers ≥ ``max_window_layers``); releases ship it off.
- HF defaults: vocab 151936, untied (≤4B checkpoints set tie_word_embeddings true), rope_theta 1e4 when absent
  (1e6 on the Hub), eps 1e-6.
The q/k norms and RoPE run as one kernel pass over the packed projection output (liger_models/kernels/
qk_norm_rope.py; the RMSNorm kernel followed by the RoPE kernel remain the PyTorch reference's path)."""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import Qwen3Config


class LigerQwen3ForCausalLM(LigerForCausalLM):
    """HF `Qwen3ForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = Qwen3Config
