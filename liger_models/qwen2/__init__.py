"""Qwen2: config and fused causal-LM model."""

from .config import Qwen2Config
from .modeling import LigerQwen2ForCausalLM

__all__ = ["Qwen2Config", "LigerQwen2ForCausalLM"]
