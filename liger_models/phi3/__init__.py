"""Phi3: config and fused causal-LM model."""

from .config import Phi3Config
from .modeling import LigerPhi3ForCausalLM

__all__ = ["Phi3Config", "LigerPhi3ForCausalLM"]
