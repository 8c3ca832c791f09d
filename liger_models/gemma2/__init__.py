"""Gemma 2: config and fused causal-LM model."""

from .config import Gemma2Config
from .modeling import LigerGemma2ForCausalLM

__all__ = ["Gemma2Config", "LigerGemma2ForCausalLM"]
