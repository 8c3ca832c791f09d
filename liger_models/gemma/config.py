"""Gemma (v1) config: HF ``GemmaConfig`` field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from liger_models.modules.config import LigerConfig


@dataclass
class GemmaConfig(LigerConfig):
    """HF GemmaConfig: (1 + w) fp32 norms, √hidden embedding scale, tanh GELU, head_dim 256, tied head.

    The activation is ``hidden_activation`` when config.json has it, else ``hidden_act``; the released checkpoints
    say "gelu" but were trained with the tanh approximation, so for this family "gelu" means tanh
    (docs/models.md#gemma).
    """

    vocab_size: int = 256000
    hidden_size: int = 3072
    intermediate_size: int = 24576
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2

    model_type = "gemma"
    architecture = "GemmaForCausalLM"
    norm_casting = "gemma"
    scale_embeddings = True

    def __post_init__(self) -> None:
        if self.hidden_act == "gelu":
            self.hidden_act = "gelu_pytorch_tanh"
        self.mlp_bias = False
        super().__post_init__()

    @classmethod
    def _normalise_hf(cls, d: dict) -> dict:
        if d.get("hidden_activation"):
            d["hidden_act"] = d["hidden_activation"]
        return super()._normalise_hf(d)

    @classmethod
    def tiny(cls, **overrides) -> "GemmaConfig":
        """Tiny Gemma with head_dim (32) ≠ hidden / heads (16) and multi-query attention, like Gemma-2B."""
        return super().tiny(**{"head_dim": 32, "num_key_value_heads": 1, **overrides})
