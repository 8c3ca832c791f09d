"""Llama: config and fused causal-LM model."""

from .config import LlamaConfig
from .modeling import LigerLlamaForCausalLM

__all__ = ["LlamaConfig", "LigerLlamaForCausalLM"]
