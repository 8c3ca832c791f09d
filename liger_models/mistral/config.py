"""Mistral config: HF ``MistralConfig`` field names and defaults (8 kv heads, sliding window 4096 unless null)."""

from __future__ import annotations

from dataclasses import dataclass

from liger_models.modules.config import LigerConfig


@dataclass
class MistralConfig(LigerConfig):
    """HF MistralConfig; it has no bias flags, so any attention_bias / mlp_bias in config.json is ignored."""

    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096

    model_type = "mistral"
    sliding_window_applies = True
    architecture = "MistralForCausalLM"
    # Mistral Small 3.1 / 3.2 (24B): Mistral3ForConditionalGeneration, this decoder beside a Pixtral vision tower
    wrapped_in = ("mistral3",)

    def __post_init__(self) -> None:
        self.attention_bias = self.mlp_bias = False
        super().__post_init__()
