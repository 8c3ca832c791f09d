"""Gemma 2 config: HF ``Gemma2Config`` field names and defaults (transformers 5.25)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from liger_models.modules.config import _ACTIVATIONS, LigerConfig, check_layer_types


@dataclass
class Gemma2Config(LigerConfig):
    """HF Gemma2Config: Gemma's (1 + w) fp32 norms and √hidden embedding scale, four norms per layer (sandwich),
    scores scaled by query_pre_attn_scalar^-0.5 and soft-capped by attn_logit_softcapping, final logits soft-capped
    by final_logit_softcapping, sliding-window and full layers by ``layer_types``.

    ``layer_types`` absent: layer i slides iff (i + 1) % 2 != 0 (even i), as HF derives it. The activation is
    ``hidden_activation`` (HF's Gemma 2 never reads ``hidden_act``); a null softcap switches that cap off.
    """

    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    head_dim: int | None = 256
    hidden_act: str = "gelu_pytorch_tanh"
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0

    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    norm_casting = "gemma"
    scale_embeddings = True
    sandwich_norms = True
    # Layer i slides iff (i + 1) % pattern != 0 when layer_types is absent.
    default_sliding_pattern = 2

    def __post_init__(self) -> None:
        self.mlp_bias = False  # HF's Gemma 2 MLP has no bias
        if self.layer_types is None:
            pattern = self.sliding_pattern()
            self.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                for i in range(self.num_hidden_layers)]
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < float("inf")):
                raise ValueError(f"{name} must be a positive finite number or null, got {cap!r}")
        if not (isinstance(self.query_pre_attn_scalar, (int, float)) and self.query_pre_attn_scalar > 0):
            raise ValueError(f"query_pre_attn_scalar must be a positive number, got {self.query_pre_attn_scalar!r}")
        super().__post_init__()

    def sliding_pattern(self) -> int:
        return self.default_sliding_pattern

    def _check_windows(self) -> None:
        """layer_types first: a short list or an unknown type would fail later with an unrelated error."""
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.sliding_window is None and "sliding_attention" in self.layer_types:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        super()._check_windows()

    @property
    def activation(self) -> str:
        name = self.hidden_act if self.hidden_activation is None else self.hidden_activation
        return _ACTIVATIONS.get(name, name)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def attention_softcap(self) -> float | None:
        return None if self.attn_logit_softcapping is None else float(self.attn_logit_softcapping)

    @property
    def logit_softcap(self) -> float | None:
        return None if self.final_logit_softcapping is None else float(self.final_logit_softcapping)

    @classmethod
    def tiny(cls, **overrides: Any) -> "Gemma2Config":
        """Tiny Gemma 2: 4 layers (sliding, full, sliding, full) with a 5-token window, head_dim 32 ≠ hidden / heads,
        query_pre_attn_scalar 24 ≠ head_dim, small caps (5 on scores, 3 on logits)."""
        return super().tiny(**{"num_hidden_layers": 4, "head_dim": 32, "num_key_value_heads": 2,
                               "sliding_window": 5, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
                               "final_logit_softcapping": 3.0, **overrides})

