"""Fused building blocks every family shares: config base, RoPE tables, attention, gated MLP, decoder, LM head."""

from .attention import Attention, AttentionMask, static_document_mask
from .cache import KVCache
from .causal_lm import CausalLMOutput, LigerForCausalLM
from .config import LigerConfig
from .decoder import DecoderLayer, DecoderModel
from .loss import autocast_operands, shift_labels
from .mlp import GatedMLP
from .output import model_output
from .rope import RotaryEmbedding

__all__ = ["Attention", "AttentionMask", "CausalLMOutput", "DecoderLayer", "DecoderModel", "GatedMLP", "KVCache",
           "LigerConfig", "LigerForCausalLM", "RotaryEmbedding", "autocast_operands", "model_output", "shift_labels",
           "static_document_mask"]
