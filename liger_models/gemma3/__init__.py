"""Gemma 3 (text-only, ``gemma3_text`` / Gemma3ForCausalLM): config and fused causal-LM model."""

from .config import Gemma3TextConfig
from .modeling import LigerGemma3ForCausalLM

__all__ = ["Gemma3TextConfig", "LigerGemma3ForCausalLM"]
