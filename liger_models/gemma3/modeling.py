"""Gemma 3 text (``gemma3_text``, HF Gemma3ForCausalLM): how it differs from Gemma 2 (transformers 5.25 eager).

- q_norm / k_norm: Gemma-style (1 + w) RMSNorm in fp32 over head_dim, eps rms_norm_eps, on every head of q and k
  after the projection and before RoPE (v is not normed); k is cached normed and rotated.
- No attention soft-cap (HF never applies attn_logit_softcapping here); final_logit_softcapping is null in the
  releases and applied as in Gemma 2 when set.
- 5 sliding : 1 full layers (layer i slides iff (i + 1) % 6 != 0, or as ``layer_types`` says); the window is
  sliding_window tokens including the query (512 on 1B / 270M, 1024 on 4B+).
- Two RoPE tables in fp32, each computed once per forward: sliding layers θ = rope_local_base_freq (1e4), never
  scaled; full layers θ = rope_theta (1e6) with rope_scaling (linear ×8 on 4B+ text towers; none on 1B / 270M).
- Scores scaled by query_pre_attn_scalar^-0.5 (256 on 1B = head_dim; 168 on 27B, head_dim 128).
- Embeddings × √hidden rounded to the activation dtype (bf16: √1152 → 34.0, √640 → 25.25); not fp16-safe
  (activations overflow; use bf16 or fp32). Sandwich norms, GeGLU with tanh GELU, tied head, as Gemma 2.
- The multimodal ``gemma3`` checkpoints (4B-27B Gemma3ForConditionalGeneration) load as this decoder, their vision
  tower and projector kept aside and written back by save_pretrained (liger_models/wrapped_checkpoint.py).
"""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import Gemma3TextConfig


class LigerGemma3ForCausalLM(LigerForCausalLM):
    """HF `Gemma3ForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = Gemma3TextConfig
