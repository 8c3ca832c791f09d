"""Mixtral config: HF ``MixtralConfig`` field names and defaults (8 experts, top-2, θ 1e6, eps 1e-5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from liger_models.modules.config import LigerConfig, _is_int, _require


@dataclass
class MixtralConfig(LigerConfig):
    """HF MixtralConfig: every layer's MLP is ``num_local_experts`` SwiGLU experts of ``intermediate_size``, top
    ``num_experts_per_tok``, always renormalised; no bias flags; a non-null ``sliding_window`` applies to every
    layer. ``num_experts`` is accepted as an alias of ``num_local_experts`` (HF's attribute_map)."""

    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6  # HF's default_theta: used when config.json gives none
    sliding_window: int | None = None
    num_experts_per_tok: int = 2
    num_local_experts: int = 8
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    sliding_window_applies = True
    moe_block_name = "block_sparse_moe"  # the checkpoints' name of the MLP slot (transformers v5 says mlp in memory)
    expert_tensor_names = ("w1", "w3", "w2")  # gate, up, down
    renormalize_top_k = True
    router_weights_in_activation_dtype = False  # v5 keeps the top-k weights fp32

    def __post_init__(self) -> None:
        self.attention_bias = self.mlp_bias = False
        for key in ("num_local_experts", "num_experts_per_tok"):
            _require(_is_int(getattr(self, key)) and getattr(self, key) > 0, f"{key} must be a positive integer",
                     getattr(self, key))
        _require(self.num_experts_per_tok <= self.num_local_experts,
                 f"num_experts_per_tok must be at most num_local_experts ({self.num_local_experts})",
                 self.num_experts_per_tok)
        _require(0 <= self.router_jitter_noise < 1, "router_jitter_noise must be in [0, 1)", self.router_jitter_noise)
        super().__post_init__()

    @classmethod
    def _normalise_hf(cls, d: dict) -> dict:
        if "num_experts" in d:
            d.setdefault("num_local_experts", d.pop("num_experts"))
        return super()._normalise_hf(d)

    @property
    def experts_count(self) -> int:
        return self.num_local_experts

    @property
    def num_experts(self) -> int:
        """HF's attribute_map alias, read as HF's config answers it (TRL's fused LM head reads it for the
        load-balancing loss)."""
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size

    def layer_is_sparse(self, layer_idx: int) -> bool:
        return True

    @classmethod
    def tiny(cls, **overrides: Any) -> "MixtralConfig":
        """LigerConfig.tiny with 4 experts of intermediate 64, top-2."""
        return super().tiny(**{"num_local_experts": 4, "intermediate_size": 64, **overrides})
