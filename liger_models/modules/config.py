"""The config every family shares: HF field names, family defaults, and config.json parsing.

``LigerConfig.from_hf(d)`` reads a config.json dict as written by any transformers version
(docs/models.md#configjson):
``rope_parameters`` (v5) or ``rope_scaling`` + ``rope_theta`` (v4), ``type`` or ``rope_type``, ``torch_dtype`` or
``dtype``. The rope spec is canonicalised into ``rope_theta`` plus ``rope_scaling`` (``None`` for default RoPE, else a
dict with ``rope_type``). Fields this dataclass does not model are kept in ``extra`` so ``to_hf()`` writes them back.

Families subclass it, re-declare the fields whose HF defaults differ and set the class-level switches below; the
modeling code reads only fields and switches, never a family name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
    "yarn": ("factor",),
}
# Rope types whose original_max_position_embeddings HF fills in (top-level key first, else max_position_embeddings).
_ORIGINAL_LENGTH_TYPES = ("llama3", "longrope", "yarn")
_MISSING = object()
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# HF's layer_types entries (v5): which layers attend within sliding_window.
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(layer_types: list[str], num_hidden_layers: int) -> None:
    """One known type per layer; a short list or an unknown type would fail later with an unrelated error (HF
    validates it the same way)."""
    if len(layer_types) != num_hidden_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, expected num_hidden_layers = "
                         f"{num_hidden_layers}")
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"unknown layer type {layer_type!r} in layer_types (supported: {LAYER_TYPES})")


def _require(ok: bool, message: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")


# What transformers' GenerationConfig.from_model_config takes from these families' config.json: HF generates with
# them when a checkpoint has no generation_config.json.
_MODEL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


class GenerationConfig(dict):
    """generation_config.json as loaded ({} when the checkpoint has none): a dict, which is what ``generate`` and
    ``save_pretrained`` read, that also answers HF's attribute access, which the trainers use (Trainer's
    ``align_special_tokens`` reads and sets the token ids, TRL's SFTTrainer sets ``pad_token_id``).

    Without the file HF's generation config starts from config.json's token ids, and ``generate`` falls back to
    config.json's ids while this dict is empty; so while empty it reads those ids, and the first attribute write
    copies them in before setting its own (else setting pad_token_id alone would leave generate with no EOS id). An
    absent token id reads None, as in HF; any other absent setting is an AttributeError, since HF's defaults for
    those (temperature 1.0, top_k 50, ...) are no single None."""

    def __init__(self, values: Any = (), model_config: Any = None) -> None:
        super().__init__(values)
        object.__setattr__(self, "_model_config", model_config)

    def _token_ids_from_model(self) -> dict:
        config = self.__dict__.get("_model_config")  # absent while unpickling
        if self or config is None:
            return {}
        return {k: getattr(config, k) for k in _MODEL_TOKEN_IDS if getattr(config, k, None) is not None}

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if name in _MODEL_TOKEN_IDS:
            return self._token_ids_from_model().get(name)
        raise AttributeError(f"generation_config has no setting {name!r} (its settings: {sorted(self)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"generation_config has no private attribute {name!r} to set")
        self.update(self._token_ids_from_model())
        self[name] = value

    def __delattr__(self, name: str) -> None:
        self.pop(name, None)

    def to_dict(self) -> dict:
        return dict(self)


@dataclass
class LigerConfig:
    """Decoder-only transformer config with Hugging Face field names (defaults: HF ``LlamaConfig``)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    # config.json's top-level key (Phi3 writes it there): when present it wins over rope_scaling's own value for
    # llama3 / longrope, as HF v5 reads it in every family (its rope functions re-standardise from the attribute).
    original_max_position_embeddings: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    extra: dict = field(default_factory=dict, repr=False)

    # Family switches (class-level; set by each family's subclass).
    model_type: ClassVar[str] = ""
    architecture: ClassVar[str] = ""
    norm_casting: ClassVar[str] = "llama"  # "gemma": (1 + w) in fp32 with one final cast
    scale_embeddings: ClassVar[bool] = False  # h = E[ids] * sqrt(hidden) rounded to the activation dtype
    fused_qkv: ClassVar[bool] = False  # one qkv_proj tensor (Phi3) instead of q_proj / k_proj / v_proj
    fused_gate_up: ClassVar[bool] = False  # one gate_up_proj tensor (Phi3) instead of gate_proj / up_proj
    rope_type_aliases: ClassVar[dict] = {}  # e.g. Phi3: {"su": "longrope", "yarn": "longrope"}
    # Whether attention honours ``sliding_window`` (HF's Mistral and Phi3 do; Llama and Gemma ignore the key, which
    # is kept for the round trip all the same; Qwen2 has its own rule).
    sliding_window_applies: ClassVar[bool] = False
    # Whether RoPE honours ``partial_rotary_factor``: in HF v5 only Phi3's rotary embedding reads it; the other
    # families rotate whole heads whatever the key says (it is still kept for the round trip).
    partial_rotary_applies: ClassVar[bool] = False
    # Per-head RMSNorm of q and k over head_dim (HF names self_attn.q_norm / k_norm), after the projection and
    # before RoPE, with the family's norm_casting and rms_norm_eps (Qwen3 Llama-style, Gemma 3 (1 + w)).
    qk_norm: ClassVar[bool] = False
    # Gemma 2/3's sandwich: post_attention_layernorm normalises the attention *output* before its residual add, and
    # pre_feedforward_layernorm / post_feedforward_layernorm wrap the MLP the same way (HF names).
    sandwich_norms: ClassVar[bool] = False
    # config.json model_types of multimodal checkpoints whose text_config is this family's decoder (loaded and saved
    # back whole: liger_models/wrapped_checkpoint.py).
    wrapped_in: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        # transformers' Gemma configs carry it (EmbeddingGemma's encoder); Gemma 1's model then attends both ways
        # under SDPA but causally under eager attention. Every model here is a causal LM.
        if self.extra.get("use_bidirectional_attention"):
            raise ValueError(f"{self.model_type} with use_bidirectional_attention=true (an embedding model) is not a "
                             "causal LM: not supported")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._check_sizes()
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                                 f"({self.num_attention_heads}); set head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        _require(_is_int(self.head_dim) and self.head_dim > 0, "head_dim must be a positive integer", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.activation not in ("silu", "gelu", "gelu_tanh"):
            raise ValueError(f"unsupported activation {self.hidden_act!r} (supported: {sorted(_ACTIVATIONS)})")
        self.rope_scaling = self._check_rope(self.rope_scaling)
        self._check_rotary()
        self._check_windows()

    def _check_sizes(self) -> None:
        """Reject values that would fail much later with an unrelated error (ZeroDivisionError, an empty reshape)
        or run silently wrong (NaN norms, a window that masks everything)."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, key)
            _require(_is_int(value) and value > 0, f"{key} must be a positive integer", value)
        layers = self.num_hidden_layers
        _require(_is_int(layers) and layers >= 0, "num_hidden_layers must be a non-negative integer", layers)
        _require(self.rms_norm_eps >= 0, "rms_norm_eps must be >= 0", self.rms_norm_eps)
        _require(self.rope_theta > 0, "rope_theta must be > 0", self.rope_theta)

    def _check_windows(self) -> None:
        # Only windows some layer uses: HF ignores the key elsewhere (Llama, Gemma, Qwen2 with the flag off).
        for layer_idx in range(self.num_hidden_layers):
            window = self.layer_sliding_window(layer_idx)
            _require(window is None or (_is_int(window) and window > 0),
                     "sliding_window must be a positive integer or null", window)

    def _check_rotary(self) -> None:
        factor = self.partial_rotary_factor
        _require(0 < factor <= 1, "partial_rotary_factor must be in (0, 1]", factor)
        # rotate_half pairs dimension i with i + R/2, so R must be even (and at least 2).
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary dimension {self.rotary_dim} (head_dim {self.head_dim} x partial_rotary_factor "
                             f"{factor}) must be even and at least 2")

    # ---- derived properties the modeling code reads -------------------------------------------------------
    @property
    def activation(self) -> str:
        """'silu', 'gelu' (exact erf) or 'gelu_tanh'."""
        return _ACTIVATIONS.get(self.hidden_act, self.hidden_act)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def rotary_dim(self) -> int:
        if not self.partial_rotary_applies:
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def dtype(self) -> torch.dtype | None:
        """The checkpoint's parameter dtype, if config.json names one."""
        return getattr(torch, self.torch_dtype) if isinstance(self.torch_dtype, str) else None

    def layer_is_sparse(self, layer_idx: int) -> bool:
        """Whether this layer's MLP slot is a routed mixture of experts (modules/moe.py) rather than the gated MLP."""
        return False

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Keys visible to a query in this layer: exactly W tokens including itself, or None for full causal."""
        return self.sliding_window if self.sliding_window_applies else None

    @property
    def attention_scale(self) -> float:
        """Multiplier of q·kᵀ (head_dim^-0.5; Gemma 2/3 use query_pre_attn_scalar^-0.5)."""
        return self.head_dim**-0.5

    @property
    def attention_softcap(self) -> float | None:
        """c in scores ← c·tanh(scores / c), after the scaling and before the mask (Gemma 2), or None."""
        return None

    @property
    def logit_softcap(self) -> float | None:
        """c in logits ← c·tanh(logits / c) before the loss and in returned logits (Gemma 2), or None."""
        return None

    def layer_rope(self, layer_idx: int) -> tuple[float, dict | None]:
        """(rope_theta, rope_scaling) of this layer's RoPE table; one table for every layer unless a family has
        per-layer-type tables (Gemma 3: its sliding layers use their own base, unscaled)."""
        return self.rope_theta, self.rope_scaling

    # ---- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict) -> "LigerConfig":
        """Build from a config.json dict (any transformers version); unknown keys are kept in ``extra``."""
        d = dict(d)
        if cls.model_type and d.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"{cls.__name__} expects model_type {cls.model_type!r}, got {d.get('model_type')!r}")
        d = cls._normalise_hf(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    @classmethod
    def _normalise_hf(cls, d: dict) -> dict:
        """Map HF spellings onto fields: dtype, rope dicts (v4 and v5), family defaults for absent keys."""
        if "dtype" in d:  # transformers v5's name; it wins over a stale torch_dtype saved beside it, as there
            d["torch_dtype"] = d["dtype"]
        d["_dtype_key"] = "dtype" if "dtype" in d else "torch_dtype"
        d.pop("dtype", None)
        if isinstance(d.get("torch_dtype"), str) and d["torch_dtype"] not in ("auto",):
            if not isinstance(getattr(torch, d["torch_dtype"], None), torch.dtype):
                raise ValueError(f"unknown dtype {d['torch_dtype']!r} in config")
        elif d.get("torch_dtype") == "auto":
            d["torch_dtype"] = None
        # transformers v5 gives rope_scaling priority over rope_parameters when both are present.
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        d["_rope_key"] = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
        d.pop("rope_parameters", None)
        if not isinstance(rope, dict):
            raise ValueError(f"rope_scaling/rope_parameters must be a dict, got {rope!r}")
        if any(isinstance(v, dict) for v in rope.values()):
            raise ValueError(f"per-layer-type rope parameters are not supported: {sorted(rope)}")
        rope = dict(rope)
        d["rope_theta"] = float(rope.pop("rope_theta", d.get("rope_theta", cls.rope_theta)))  # the family's default
        prf = rope.pop("partial_rotary_factor", None)
        d["_top_level_prf"] = "partial_rotary_factor" in d  # v5 Phi3 files keep it there too; so does to_hf()
        d["partial_rotary_factor"] = float(prf if prf is not None else d.get("partial_rotary_factor", 1.0))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        rope_type = cls.rope_type_aliases.get(rope_type, rope_type)
        if rope_type == "default":
            d["rope_scaling"] = None
        else:
            rope["rope_type"] = rope_type
            if rope_type in _ORIGINAL_LENGTH_TYPES and not rope.get("original_max_position_embeddings"):
                rope["original_max_position_embeddings"] = d.get("max_position_embeddings", cls.max_position_embeddings)
            d["rope_scaling"] = rope
        return d

    def _check_rope(self, rope: dict | None) -> dict | None:
        if rope is None:
            return None
        rope = dict(rope)
        rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
        rope_type = rope["rope_type"] = self.rope_type_aliases.get(rope_type, rope_type)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if rope_type == "default":
            return None
        for key in _ROPE_REQUIRED[rope_type]:
            if rope.get(key) is None:
                raise ValueError(f"rope type {rope_type!r} needs rope_scaling[{key!r}]")
        if rope_type in _ORIGINAL_LENGTH_TYPES:
            if self.original_max_position_embeddings is not None:
                rope["original_max_position_embeddings"] = self.original_max_position_embeddings
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        if rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(rope[key]) != self.rotary_dim // 2:
                    raise ValueError(f"rope_scaling[{key!r}] has {len(rope[key])} entries, expected "
                                     f"rotary_dim/2 = {self.rotary_dim // 2}")
        return rope

    @classmethod
    def tiny(cls, **overrides: Any) -> "LigerConfig":
        """A small random-init config for tests and demos (hidden 64, 2 layers, vocab 128); ``overrides`` win."""
        base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
        base.update(overrides)
        return cls(**base)

    def to_hf(self) -> dict:
        """config.json dict: the original keys kept, our fields written back in the key style they came in."""
        d = {k: v for k, v in self.extra.items() if not k.startswith("_")}
        for f in dataclasses.fields(self):
            if f.name not in ("extra", "torch_dtype", "rope_theta", "rope_scaling", "partial_rotary_factor"):
                d[f.name] = getattr(self, f.name)
        if self.original_max_position_embeddings is None:  # a null key would override HF's rope value with None
            d.pop("original_max_position_embeddings")
        d["model_type"], d["architectures"] = self.model_type, [self.architecture]
        d[self.extra.get("_dtype_key", "dtype")] = self.torch_dtype
        rope = dict(self.rope_scaling or {"rope_type": "default"})
        if self.extra.get("_rope_key") == "rope_parameters":
            d["rope_parameters"] = {"rope_theta": self.rope_theta, **rope}
            if self.partial_rotary_factor != 1.0:
                d["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
            if self.extra.get("_top_level_prf"):
                d["partial_rotary_factor"] = self.partial_rotary_factor
        else:
            d["rope_theta"], d["rope_scaling"] = self.rope_theta, self.rope_scaling
            if self.partial_rotary_factor != 1.0:
                d["partial_rotary_factor"] = self.partial_rotary_factor
        return d

    # ---- what transformers' Trainer, PEFT and TRL read off a model's config (duck-typed: no transformers) -------
    is_encoder_decoder: ClassVar[bool] = False
    use_return_dict: ClassVar[bool] = True  # forward returns a CausalLMOutput unless called with return_dict=False

    def to_dict(self) -> dict:
        """config.json's dict (``to_hf``), which PEFT reads model_type and tie_word_embeddings from."""
        return self.to_hf()

    @property
    def _name_or_path(self) -> str:
        """The directory the model was loaded from ("" for one built from a config): HF's attribute, from which TRL's
        DPO, KTO, GRPO and RLOO trainers load a reference model (with transformers) when given none."""
        return self.extra.get("_name_or_path", "")

    name_or_path = _name_or_path

    @property
    def _attn_implementation(self) -> str:
        """The attention of transformers that computes what ours does, for a model those trainers load beside this
        one: "sdpa", or "eager" where attention logits are soft-capped (transformers' SDPA path cannot cap them)."""
        return "eager" if self.attention_softcap else "sdpa"

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> "LigerConfig":
        """HF's accessor of a multimodal config's text part: these configs are all text."""
        return self

    def get(self, key: str, default: Any = None) -> Any:
        """config.json's ``key``: a field or derived property, else a key kept in ``extra``, else ``default``."""
        value = getattr(self, key, _MISSING)
        return value if value is not _MISSING else self.extra.get(key, default)

    @property
    def embed_scale(self) -> float:
        """Multiplier of the embeddings when ``scale_embeddings`` (applied, rounded to the table's dtype, by the
        embedding module: modules/embedding.py)."""
        return math.sqrt(self.hidden_size)
