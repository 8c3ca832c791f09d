"""Which linears get adapters, with what rank and scale: our settings and PEFT's ``adapter_config.json`` fields.

Targets are HF module names: a list of leaf names (``q_proj``, Phi3's ``qkv_proj``, …, ``lm_head``,
``embed_tokens``) that must each exist in the model, ``"all-linear"`` (every decoder linear; never lm_head, as PEFT),
or a string that ``re.fullmatch``es full module names (PEFT's rule). An unknown target is an error, never a silent
skip. ``rank_pattern`` / ``alpha_pattern`` keys are regexes matched against a dotted suffix of the module name, as
PEFT matches them.

Mixture-of-experts blocks (Mixtral, Qwen3-MoE) hold their experts as stacked Parameters and their router as a
linear that transformers does not make an ``nn.Linear``; PEFT adapts them through ``target_parameters`` (names a
parameter's full name ends with: ``gate_up_proj`` and ``down_proj`` of the experts, ``gate.weight`` of the router),
and so do we (modules/lora_experts.py, a LoraLinear on the router). ``"all-linear"`` on such a model adapts what
HF + PEFT's ``"all-linear"`` adapts there: the attention projections, every router, and both expert stacks, the
gate|up stack at rank 2r and alpha 2·alpha (PEFT maps transformers v4's separate gate and up projections, r each,
onto the fused stack that way), unless rank_pattern / alpha_pattern name it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from liger_models.modules.lora_linear import LoraLinear
from liger_models.modules.moe import STACKS as EXPERT_STACKS

ALL_LINEAR = "all-linear"
# What PEFT's modules_to_save may name here: the modules outside the decoder layers that train whole beside the
# adapters (new tokens' rows in a chat fine-tune).
SAVABLE = ("embed_tokens", "lm_head")
# The mixture-of-experts parameters LoRA may target (PEFT's target_parameters): the stacked experts' and the router's.
ROUTER_WEIGHT = "gate.weight"
# all-linear's rank / alpha pattern and factor for the fused gate|up stack (module docstring), as PEFT writes it
FUSED_GATE_UP_PATTERN, FUSED_GATE_UP_FACTOR = rf".*\.{EXPERT_STACKS[0]}", 2
# PEFT fields whose non-default value changes the math or the saved keys in a way not implemented here.
_UNSUPPORTED = {"layers_to_transform": None, "layers_pattern": None,
                "fan_in_fan_out": False, "lora_bias": False, "use_qalora": False,
                "trainable_token_indices": None}


@dataclass
class LoraSettings:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list[str] | str = ALL_LINEAR
    use_rslora: bool = False
    use_dora: bool = False  # weight-decomposed LoRA (DoRA): a trained magnitude per output row
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    init: str | bool = True
    modules_to_save: list[str] = field(default_factory=list)  # of SAVABLE: trained whole, saved in the adapter
    # PEFT's target_parameters: mixture-of-experts parameters by the end of their full name (module docstring)
    target_parameters: list[str] = field(default_factory=list)
    # PEFT's exclude_modules, as read from an adapter_config.json: load_adapter refuses one that excludes a module
    # the adapter adapts (only exclusions outside the decoder, such as a multimodal model's vision tower, are met).
    exclude_modules: list[str] | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"LoRA rank r must be a positive integer, got {self.r!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ValueError(f"lora alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.use_dora, bool):
            raise ValueError(f"use_dora must be True or False, got {self.use_dora!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, (list, tuple, set)):
            self.targets = list(self.targets)
            if not self.targets and not self.target_parameters:
                raise ValueError("no LoRA targets given")
        elif not isinstance(self.targets, str):
            raise ValueError(f"targets must be a list of module names or a string, got {self.targets!r}")
        self.modules_to_save = list(self.modules_to_save or [])
        for name in self.modules_to_save:
            if name not in SAVABLE:
                raise ValueError(f"modules_to_save: {name!r} is not supported (only {', '.join(SAVABLE)}: the "
                                 "decoder's linears take adapters)")
        self.target_parameters = list(self.target_parameters or [])
        for name in self.target_parameters:
            if not isinstance(name, str) or not (name.endswith(EXPERT_STACKS) or name.endswith(ROUTER_WEIGHT)):
                raise ValueError(f"target_parameters: {name!r} is not supported (only the mixture-of-experts "
                                 f"blocks' stacked experts, {' and '.join(EXPERT_STACKS)}, and their router "
                                 f"{ROUTER_WEIGHT!r})")
        for key, value in self.rank_pattern.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rank_pattern[{key!r}] must be a positive integer, got {value!r}")

    def rank_and_alpha(self, name: str) -> tuple[int, float]:
        r = pattern_value(self.rank_pattern, name, self.r)
        return r, float(pattern_value(self.alpha_pattern, name, self.alpha))

    # ---- PEFT's adapter_config.json ----------------------------------------------------------------------------
    def to_peft(self, leaf_targets: list[str], base_model: str | None = None,
                parameters: list[str] | None = None) -> dict:
        """adapter_config.json for HF + PEFT (and vLLM): the targeted leaf names (and parameter names), our r /
        alpha / patterns."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "use_rslora": self.use_rslora, "target_modules": sorted(leaf_targets),
                "target_parameters": sorted(parameters) if parameters else None,
                "rank_pattern": dict(self.rank_pattern), "alpha_pattern": dict(self.alpha_pattern),
                "bias": "none", "use_dora": self.use_dora, "fan_in_fan_out": False,
                "modules_to_save": sorted(self.modules_to_save) or None,
                "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": base_model,
                "revision": None, "layers_to_transform": None, "layers_pattern": None}

    @classmethod
    def from_peft(cls, cfg: dict, where: str = "adapter_config.json") -> "LoraSettings":
        """Settings from a PEFT LoRA config; a field this implementation does not honour is refused by name."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("task_type") not in (None, "CAUSAL_LM"):
            raise ValueError(f"{where}: task_type {cfg.get('task_type')!r} is not CAUSAL_LM")
        for key, default in _UNSUPPORTED.items():
            value = cfg.get(key, default)
            if value not in (default, [], {}, None, False):
                raise ValueError(f"{where}: {key}={value!r} is not supported")
        if cfg.get("bias", "none") != "none":
            raise ValueError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
        targets = cfg.get("target_modules")
        if targets is None:
            raise ValueError(f"{where}: target_modules is missing")
        return cls(r=cfg.get("r", 8), alpha=cfg.get("lora_alpha", 8), dropout=cfg.get("lora_dropout", 0.0) or 0.0,
                   targets=targets if isinstance(targets, str) else list(targets),
                   use_rslora=bool(cfg.get("use_rslora", False)), use_dora=bool(cfg.get("use_dora", False)),
                   rank_pattern=dict(cfg.get("rank_pattern") or {}),
                   alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
                   modules_to_save=list(cfg.get("modules_to_save") or []),
                   target_parameters=list(cfg.get("target_parameters") or []),
                   exclude_modules=cfg.get("exclude_modules") or None)


def pattern_value(patterns: dict, name: str, default):
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Full name → module for every linear inside the decoder layers (what LoRA may target)."""
    found = {}
    for name, m in model.named_modules():
        if (not name.startswith("model.layers.") or not isinstance(m, (nn.Linear, LoraLinear))
                or name.endswith((".lora_A", ".lora_B"))):
            continue
        # A mixture-of-experts block's router: its experts are stacked tensors that take no adapter, and HF names
        # the block differently per family, so an adapter on the router alone is not offered.
        if hasattr(model.get_submodule(name.rpartition(".")[0]), "experts"):
            continue
        found[name] = m
    return found


def modules_to_save(model: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """Full name → module for each of ``names`` (leaf names of SAVABLE). Refused on tied embeddings: the one matrix
    is both modules, and PEFT would save two diverging copies of it."""
    if names and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"modules_to_save {names}: this model ties lm_head to embed_tokens; train it whole instead "
                         "of through an adapter")
    found = {}
    for leaf in names:
        matches = [n for n, _ in model.named_modules() if n == leaf or n.endswith("." + leaf)]
        if len(matches) != 1:
            raise ValueError(f"modules_to_save: {leaf!r} names {len(matches)} modules of this model, not one")
        found[matches[0]] = model.get_submodule(matches[0])
    return found


def outer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Full name → module of the targets outside the decoder layers: the token embeddings and lm_head."""
    found = {}
    for name in ("model.embed_tokens", "lm_head"):
        try:
            found[name] = model.get_submodule(name)
        except AttributeError:
            continue
    return found


def resolve_targets(model: nn.Module, targets: list[str] | str) -> list[str]:
    """The full module names that ``targets`` selects (see the module docstring); errors name what exists.
    lm_head and embed_tokens are chosen only by name or pattern, never by all-linear (as PEFT), and are refused when
    the model ties them (one matrix: an adapter merged into it would change both)."""
    linears = decoder_linears(model)
    candidates = {**linears, **outer_modules(model)}
    leaves = sorted({name.rsplit(".", 1)[-1] for name in candidates})
    if targets == ALL_LINEAR:
        return list(linears)
    if isinstance(targets, str):
        chosen = [name for name in candidates if re.fullmatch(targets, name)]
        if not chosen:
            raise ValueError(f"LoRA target pattern {targets!r} matches no module of the model that takes an "
                             f"adapter (its linears and embeddings: {', '.join(leaves)})")
    else:
        for t in targets:
            if not any(name == t or name.endswith("." + t) for name in candidates):
                raise ValueError(f"unknown LoRA target {t!r}: this model's linears and embeddings are "
                                 f"{', '.join(leaves)} (or {ALL_LINEAR!r})")
        chosen = [name for name in candidates if any(name == t or name.endswith("." + t) for t in targets)]
    outer = [name for name in chosen if name not in linears]
    if outer and getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"LoRA on {', '.join(outer)}: this model ties lm_head to embed_tokens (one matrix, which "
                         "an adapter merged into it would change for both); adapt the decoder's linears instead")
    return chosen


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Full name → mixture-of-experts block (``experts`` and the ``gate`` router) of each sparse decoder layer."""
    return {name: m for name, m in model.named_modules()
            if name.startswith("model.layers.") and hasattr(m, "experts") and hasattr(m, "gate")}


def resolve_parameters(model: nn.Module, settings: "LoraSettings") -> tuple[list[str], list[str]]:
    """(router module names, expert stack names ``<block>.experts.<stack>``) that ``settings`` adapts: its
    target_parameters (a parameter's full name equals one or ends with "." + one, PEFT's rule; a name that matches
    nothing is an error), and every router and stack under all-linear."""
    blocks = moe_blocks(model)
    routers = {f"{b}.{ROUTER_WEIGHT}": f"{b}.gate" for b in blocks}
    stacks = [f"{b}.experts.{s}" for b in blocks for s in EXPERT_STACKS]
    candidates = [*routers, *stacks]
    chosen = set(candidates) if settings.targets == ALL_LINEAR else set()
    for target in settings.target_parameters:
        hits = {key for key in candidates if key == target or key.endswith("." + target)}
        if not hits:
            raise ValueError(f"target_parameters: {target!r} matches no parameter of this model (the "
                             f"mixture-of-experts parameters: {', '.join(EXPERT_STACKS)} and {ROUTER_WEIGHT}"
                             f"{'' if blocks else '; this model has no mixture-of-experts blocks'})")
        chosen |= hits
    return [routers[k] for k in routers if k in chosen], [k for k in stacks if k in chosen]
