"""Qwen2 / Qwen2.5 config: HF ``Qwen2Config`` field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from liger_models.modules.config import LigerConfig, check_layer_types


@dataclass
class Qwen2Config(LigerConfig):
    """HF Qwen2Config: q/k/v always have biases (o_proj and the MLP never); the window is opt-in.

    ``sliding_window`` applies only when ``use_sliding_window`` is true, and then only to layers typed
    "sliding_attention" in ``layer_types`` (by default: layers i ≥ ``max_window_layers``).
    """

    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    max_position_embeddings: int = 32768
    sliding_window: int | None = 4096
    use_sliding_window: bool = False
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"

    def __post_init__(self) -> None:
        self.attention_bias = self.mlp_bias = False
        super().__post_init__()

    def _check_windows(self) -> None:
        """layer_types first (a short list would fail later with an IndexError)."""
        if self.layer_types is not None:
            check_layer_types(self.layer_types, self.num_hidden_layers)
        super()._check_windows()

    @property
    def qkv_bias(self) -> bool:
        return True

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        if not self.use_sliding_window or self.sliding_window is None:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None
        return self.sliding_window if layer_idx >= self.max_window_layers else None
