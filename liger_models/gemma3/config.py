"""Gemma 3 text config: HF ``Gemma3TextConfig`` field names and defaults (transformers 5.25)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from liger_models.gemma2.config import Gemma2Config
from liger_models.modules.config import LAYER_TYPES


@dataclass
class Gemma3TextConfig(Gemma2Config):
    """HF Gemma3TextConfig: Gemma 2's layer plus (1 + w) q/k norms, 5 sliding : 1 full layers, and a RoPE table per
    layer type.

    RoPE: full layers use ``rope_theta`` (default 1e6) with ``rope_scaling``; sliding layers use
    ``rope_local_base_freq`` (default 1e4), never scaled. config.json gives them either v5's nested
    ``rope_parameters`` ({"full_attention": {...}, "sliding_attention": {...}}) or v4's ``rope_theta`` /
    ``rope_scaling`` / ``rope_local_base_freq``; ``to_hf`` writes them back in the style they came in.
    ``layer_types`` absent: layer i slides iff (i + 1) % sliding_window_pattern != 0 (default 6). Both softcaps
    default to null, and HF never applies ``attn_logit_softcapping`` in Gemma 3, so neither does this model.
    """

    vocab_size: int = 262208
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    rope_local_base_freq: float = 10000.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    wrapped_in = ("gemma3",)  # the 4B-27B repos: Gemma3ForConditionalGeneration (decoder + vision tower)
    qk_norm = True
    default_sliding_pattern = 6

    def sliding_pattern(self) -> int:
        # HF reads only the unprefixed key (files that say _sliding_window_pattern carry layer_types as well).
        pattern = self.extra.get("sliding_window_pattern", self.default_sliding_pattern)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ValueError(f"sliding_window_pattern must be a positive integer, got {pattern!r}")
        return pattern

    def __post_init__(self) -> None:
        if not self.rope_local_base_freq > 0:
            raise ValueError(f"rope_local_base_freq must be > 0, got {self.rope_local_base_freq!r}")
        super().__post_init__()

    @property
    def attention_softcap(self) -> float | None:
        return None  # HF's Gemma 3 attention ignores attn_logit_softcapping (QK-norm instead)

    def layer_rope(self, layer_idx: int) -> tuple[float, dict | None]:
        if self.layer_types[layer_idx] == "sliding_attention":
            return float(self.rope_local_base_freq), None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def _normalise_hf(cls, d: dict) -> dict:
        """v5's nested rope_parameters → the full layers' flat spec (read by the base) + rope_local_base_freq."""
        rope = d.get("rope_parameters")
        if isinstance(rope, dict) and set(rope) & set(LAYER_TYPES):
            unknown = set(rope) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"rope_parameters mixes layer types with other keys: {sorted(unknown)}")
            sliding = dict(rope.get("sliding_attention") or {})
            sliding_type = sliding.pop("rope_type", sliding.pop("type", "default"))
            if sliding_type != "default" or set(sliding) - {"rope_theta"}:
                raise ValueError(f"rope_parameters['sliding_attention'] must be default RoPE (Gemma 3's local "
                                 f"layers are never scaled), got {rope['sliding_attention']!r}")
            d["rope_local_base_freq"] = float(sliding.get("rope_theta", cls.rope_local_base_freq))
            d["rope_parameters"] = dict(rope.get("full_attention") or {"rope_type": "default"})
            d["_nested_rope"] = True
        return super()._normalise_hf(d)

    def to_hf(self) -> dict:
        d = super().to_hf()
        if self.extra.get("_nested_rope"):
            d["rope_parameters"] = {"full_attention": d["rope_parameters"],
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": float(self.rope_local_base_freq)}}
            d.pop("rope_local_base_freq")
        return d

    @classmethod
    def tiny(cls, **overrides: Any) -> "Gemma3TextConfig":
        """Tiny Gemma 3: 6 layers, pattern 3 (sliding, sliding, full, ...), a 5-token window, head_dim 32,
        query_pre_attn_scalar 24, linear RoPE scaling ×2 on the full layers, no softcaps."""
        return super().tiny(**{"num_hidden_layers": 6, "attn_logit_softcapping": None,
                               "final_logit_softcapping": None,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0}, **overrides})
