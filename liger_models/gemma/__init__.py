"""Gemma: config and fused causal-LM model."""

from .config import GemmaConfig
from .modeling import LigerGemmaForCausalLM

__all__ = ["GemmaConfig", "LigerGemmaForCausalLM"]
