"""Llama (2, 3, 3.1, 3.2) config: HF ``LlamaConfig`` field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from liger_models.modules.config import LigerConfig


@dataclass
class LlamaConfig(LigerConfig):
    """HF LlamaConfig: attention_bias puts biases on q, k, v and o; mlp_bias on gate, up and down."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
