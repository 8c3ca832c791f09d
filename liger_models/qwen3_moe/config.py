"""Qwen3-MoE config: HF ``Qwen3MoeConfig`` field names and defaults (128 experts, top-8, norm_topk_prob false)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from liger_models.modules.config import LigerConfig, _is_int, _require


@dataclass
class Qwen3MoeConfig(LigerConfig):
    """HF Qwen3MoeConfig. Layer i is sparse iff i ∉ ``mlp_only_layers``, ``num_experts`` > 0 and
    (i + 1) % ``decoder_sparse_step`` == 0; other layers have a dense SwiGLU of ``intermediate_size``. Experts have
    ``moe_intermediate_size``. ``num_local_experts`` (what transformers v5 writes) is read as ``num_experts``; both
    keys are written back, so v4 and v5 readers agree. head_dim: the field if given, else hidden / heads."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 32768
    sliding_window: int | None = 4096
    use_sliding_window: bool = False
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    qk_norm = True
    moe_block_name = "mlp"
    expert_tensor_names = ("gate_proj", "up_proj", "down_proj")
    router_weights_in_activation_dtype = True  # the top-k weights are cast back to the logits' dtype
    router_jitter_noise = 0.0

    def __post_init__(self) -> None:
        self.mlp_bias = False
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        _require(_is_int(self.num_experts) and self.num_experts >= 0, "num_experts must be a non-negative integer",
                 self.num_experts)
        _require(_is_int(self.decoder_sparse_step) and self.decoder_sparse_step > 0,
                 "decoder_sparse_step must be a positive integer", self.decoder_sparse_step)
        _require(all(_is_int(i) for i in self.mlp_only_layers), "mlp_only_layers must be layer indices",
                 self.mlp_only_layers)
        super().__post_init__()
        if any(self.layer_is_sparse(i) for i in range(self.num_hidden_layers)):
            _require(_is_int(self.num_experts_per_tok) and 1 <= self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok must be in 1 … num_experts ({self.num_experts})", self.num_experts_per_tok)

    @classmethod
    def _normalise_hf(cls, d: dict) -> dict:
        if "num_local_experts" in d:
            d.setdefault("num_experts", d.pop("num_local_experts"))
        return super()._normalise_hf(d)

    def to_hf(self) -> dict:
        d = super().to_hf()
        d["num_local_experts"] = self.num_experts
        return d

    @property
    def experts_count(self) -> int:
        return self.num_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def renormalize_top_k(self) -> bool:
        return self.norm_topk_prob

    def layer_is_sparse(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Every layer slides when use_sliding_window is true (HF 5.x has no max_window_layers / layer_types here)."""
        return self.sliding_window if self.use_sliding_window else None

    @classmethod
    def tiny(cls, **overrides: Any) -> "Qwen3MoeConfig":
        """LigerConfig.tiny with 4 experts of intermediate 32, top-2, renormalised."""
        base = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        return super().tiny(**{**base, **overrides})
