"""Phi3 (mini 4k / 128k, 3.5-mini) config: HF ``Phi3Config`` field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from liger_models.modules.config import LigerConfig


@dataclass
class Phi3Config(LigerConfig):
    """HF Phi3Config: fused qkv_proj / gate_up_proj, no biases, eps 1e-5, longrope (alias "su"/"yarn").

    ``original_max_position_embeddings`` lives at the top level (default 4096) and wins over any value inside
    rope_scaling (the base config's rule).
    """

    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000

    model_type = "phi3"
    sliding_window_applies = True
    partial_rotary_applies = True
    architecture = "Phi3ForCausalLM"
    fused_qkv = True
    fused_gate_up = True
    rope_type_aliases = {"su": "longrope", "yarn": "longrope"}

    def __post_init__(self) -> None:
        self.attention_bias = self.mlp_bias = False
        super().__post_init__()

    def to_hf(self) -> dict:
        d = super().to_hf()
        rope = d.get("rope_scaling")
        if isinstance(rope, dict) and rope.get("rope_type") == "longrope":
            # transformers 4.x's Phi3Config accepts only exactly {type, short_factor, long_factor} here (Phi-3.5's
            # shape). Every version reads original_max_position_embeddings from the top-level key, always written.
            rope = dict(rope)
            rope["type"] = rope.pop("rope_type")
            rope.pop("original_max_position_embeddings", None)
            d["rope_scaling"] = rope
        return d

    @classmethod
    def tiny(cls, **overrides) -> "Phi3Config":
        """Tiny Phi3 (multi-head: Phi-3-mini has no GQA, but GQA is kept to exercise the Q|K|V split)."""
        return super().tiny(**{"original_max_position_embeddings": 16, **overrides})
