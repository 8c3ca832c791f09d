"""Mixtral: config and fused causal-LM model."""

from .config import MixtralConfig
from .modeling import LigerMixtralForCausalLM

__all__ = ["MixtralConfig", "LigerMixtralForCausalLM"]
