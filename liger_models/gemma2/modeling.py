"""Gemma 2: how it differs from Llama (and from Gemma 1), every numeric difference (transformers 5.25 eager).

- RMSNorm is Gemma's: (1 + w) in fp32 with one final cast; weights stored as the offset (zeros at init).
- Four norms per layer (sandwich): h = h + N_post_attn(attn(N_in(h))); h = h + N_post_ffw(mlp(N_pre_ffw(h))).
  ``post_attention_layernorm`` normalises the attention *output* (in Llama it is the MLP's input norm).
- Attention scores are scaled by query_pre_attn_scalar^-0.5 (256 on 2B/9B = head_dim; 144 on 27B, head_dim 128),
  then soft-capped: s ← c·tanh(s / c), c = attn_logit_softcapping (50), in the activation dtype, *before* the
  causal / window mask (masking first would cap −inf to −c and give masked keys weight). SDPA has no such hook:
  long CUDA calls run flex_attention with a score_mod, the rest the eager math (modules/attention.py).
- Layers alternate sliding-window (even i: W = sliding_window = 4096 tokens including the query) and full
  attention, by ``layer_types``; a KV cache keeps every key and the window is a mask (HF keeps the last W − 1).
- Final logits are soft-capped, c = final_logit_softcapping (30): c·tanh(z / c) in the logits' dtype when logits
  are returned; for the training loss the cap runs inside the fused linear-cross-entropy kernel on the fp32 values
  of the logits (HF caps bf16 logits in bf16, then upcasts: a difference of bf16 rounding only; equal in fp32).
- Embeddings × √hidden rounded to the activation dtype (bf16: √2304 = 48, √3584 → 59.75, √4608 → 68.0).
- GeGLU with tanh GELU (``hidden_activation``); head_dim 256 (27B: 128); tied head; no biases.
"""

from __future__ import annotations

from liger_models.modules.causal_lm import LigerForCausalLM

from .config import Gemma2Config


class LigerGemma2ForCausalLM(LigerForCausalLM):
    """HF `Gemma2ForCausalLM` with fused kernels; loads and saves the same safetensors checkpoints."""

    config_class = Gemma2Config
