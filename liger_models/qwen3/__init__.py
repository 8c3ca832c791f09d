"""Qwen3: config and fused causal-LM model."""

from .config import Qwen3Config
from .modeling import LigerQwen3ForCausalLM

__all__ = ["Qwen3Config", "LigerQwen3ForCausalLM"]
