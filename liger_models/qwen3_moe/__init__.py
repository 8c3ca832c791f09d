"""Qwen3-MoE: config and fused causal-LM model."""

from .config import Qwen3MoeConfig
from .modeling import LigerQwen3MoeForCausalLM

__all__ = ["Qwen3MoeConfig", "LigerQwen3MoeForCausalLM"]
