"""Qwen3 config: HF ``Qwen3Config`` field names and defaults (head_dim 128 whatever hidden / heads is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from liger_models.modules.config import LigerConfig
from liger_models.qwen2.config import Qwen2Config


@dataclass
class Qwen3Config(Qwen2Config):
    """HF Qwen3Config: Qwen2's window rule (``use_sliding_window``, ``max_window_layers``, ``layer_types``), but
    ``attention_bias`` (default false) sets the q, k, v **and** o biases, q/k get per-head RMSNorms, and head_dim
    is a field of its own (default 128, not hidden / heads)."""

    head_dim: int | None = 128

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norm = True

    def __post_init__(self) -> None:
        self.mlp_bias = False  # Qwen3's MLP has no bias flag
        LigerConfig.__post_init__(self)  # not Qwen2's, which forces attention_bias off

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @classmethod
    def tiny(cls, **overrides: Any) -> "Qwen3Config":
        """LigerConfig.tiny with head_dim 16 (the class default, 128, would dwarf hidden 64)."""
        return super().tiny(**{"head_dim": 16, **overrides})
