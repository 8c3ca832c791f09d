"""Mistral: config and fused causal-LM model."""

from .config import MistralConfig
from .modeling import LigerMistralForCausalLM

__all__ = ["MistralConfig", "LigerMistralForCausalLM"]
