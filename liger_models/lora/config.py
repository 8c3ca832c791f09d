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

``layers_to_transform`` (PEFT's field) keeps the adapters of the targets to the decoder layers it lists, by index.
As in PEFT it goes with targets given as names (or ``"all-linear"`` here, which is saved as the leaf names it
selects), not with a pattern string, which selects layers itself; a named target outside the decoder layers
(lm_head, embed_tokens) or a mixture-of-experts parameter (PEFT's target_parameters adapt every layer) is refused
beside it rather than left without an adapter, and so is a layer index the model does not have.
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
_UNSUPPORTED = {"fan_in_fan_out": False, "lora_bias": False, "use_qalora": False,
                # activated LoRA (the adapter only past its invocation tokens), replicated layers, and PEFT's
                # variants that add terms or route between adapters (MonteCLoRA, BD-LoRA, Arrow, KaSA)
                "alora_invocation_tokens": None, "layer_replication": None, "monteclora_config": None,
                "use_bdlora": None, "arrow_config": None, "kasa_config": None}

# PEFT initialisations that rewrite the base weights: the base becomes W minus the initial adapter's product (an SVD
# or QR of W or of its activations' covariance, or LoftQ's quantised residual) when the adapter is created, and again
# when PEFT loads it. Such an adapter applies to that residual base, not to the checkpoint as it is stored.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "astra", "loftq", "lora_ga")
# The initialisations add_lora draws itself: kaiming-uniform A (True, PEFT's default), N(0, 1/r) A ("gaussian"), or
# random A and B (False: a non-zero adapter, for tests). PEFT's others (EVA, MiCA, NoRA, orthogonal, and the ones
# above) shape where training starts from the base or from data: their adapters are made with PEFT and loaded here.
_INITS = (True, False, "gaussian")
# MiCA (PEFT's init_lora_weights="mica") trains A alone: B, the base's minor singular directions, stays frozen.
_B_FROZEN_INITS = ("mica",)
# PEFT fields that change only how PEFT trains the adapter, not its output: VeLoRA takes A's gradient from
# activations compressed to a few groups (an approximation), where training here takes the exact one. Refused with
# trainable=True, loaded otherwise.
_TRAINING_ONLY = ("velora_config",)
# The fields read above (LoraSettings.from_peft) and the ones that leave a saved adapter's output as plain LoRA's:
# metadata, settings PEFT uses only when it creates an adapter (the initialisations' own configs: those that rewrite
# the base are refused by init_lora_weights), Megatron's parallel linears (the same product, sharded), run-time
# offloading, qalora_group_size (used only with use_qalora, refused), and ensure_weight_tying (what it ties is checked
# where the adapter's tensors load). Any other field with a value is refused by name: a PEFT release newer than this
# code may add a variant that changes the math, as 0.22's Astra did, and loading it as plain LoRA would be silently
# wrong.
_FIELDS_READ = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
                "use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "target_parameters",
                "layers_to_transform", "layers_pattern", "trainable_token_indices", "init_lora_weights", "bias")
_FIELDS_WITHOUT_EFFECT = ("auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
                          "loftq_config", "eva_config", "corda_config", "astra_config", "lora_ga_config",
                          "megatron_config", "megatron_core", "runtime_config", "qalora_group_size",
                          "ensure_weight_tying")
_KNOWN_FIELDS = frozenset((*_FIELDS_READ, *_FIELDS_WITHOUT_EFFECT, *_UNSUPPORTED, *_TRAINING_ONLY))


def _holds_value(value, default=None) -> bool:
    """Whether a PEFT config field's value asks for something: not its default and not empty."""
    return value not in (default, [], {}, None, False)


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
    # PEFT's layers_to_transform: the decoder layers (indices) whose targets take adapters; None: every layer
    layers_to_transform: list[int] | None = None
    # PEFT's trainable_token_indices, as {leaf of SAVABLE: row indices}: rows of the embedding table (and of lm_head)
    # that train in place of the frozen ones (new tokens' rows; modules/token_rows.py). The list form is the
    # embedding's rows, which a tied lm_head shares.
    trainable_token_indices: dict[str, list[int]] | None = None

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
        if not isinstance(self.init, (bool, str)) or self.init not in _INITS:
            raise ValueError(f"LoRA init {self.init!r} is not one of {', '.join(map(repr, _INITS))}: PEFT's other "
                             "initialisations (PiSSA, OLoRA, CorDA, Astra, LoftQ, LoRA-GA, EVA, MiCA, NoRA, "
                             "orthogonal) are not drawn here; make such an adapter with PEFT and load it "
                             "(load_adapter)")
        self._check_layers()
        self._check_token_rows()
        for key, value in self.rank_pattern.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"rank_pattern[{key!r}] must be a positive integer, got {value!r}")

    def _check_layers(self) -> None:
        layers = self.layers_to_transform
        if isinstance(layers, int) and not isinstance(layers, bool):  # PEFT takes one index as a bare int
            layers = [layers]
        if layers is None or (isinstance(layers, (list, tuple)) and not layers):
            self.layers_to_transform = None
            return
        if not _indices(layers):
            raise ValueError(f"layers_to_transform must be decoder layer indices (integers ≥ 0), got {layers!r}")
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            raise ValueError(f"layers_to_transform {list(layers)} goes with targets given as names or "
                             f"{ALL_LINEAR!r}; the pattern {self.targets!r} selects the layers itself (as in PEFT)")
        self.layers_to_transform = sorted(set(layers))

    def _check_token_rows(self) -> None:
        rows = self.trainable_token_indices
        if isinstance(rows, (list, tuple)):  # PEFT's list form: rows of the input embedding
            rows = {"embed_tokens": list(rows)}
        if not rows:
            self.trainable_token_indices = None
            return
        if not isinstance(rows, dict):
            raise ValueError(f"trainable_token_indices must be a list of token ids or {{module: ids}}, got {rows!r}")
        for leaf, ids in rows.items():
            if leaf not in SAVABLE:
                raise ValueError(f"trainable_token_indices: {leaf!r} is not supported (only {', '.join(SAVABLE)})")
            if leaf in self.modules_to_save:  # PEFT refuses both as well
                raise ValueError(f"{leaf!r} is both in modules_to_save (trained whole) and in "
                                 "trainable_token_indices (some rows trained); choose one")
            if not ids or not _indices(ids) or len(set(ids)) != len(ids):
                raise ValueError(f"trainable_token_indices[{leaf!r}] must be distinct token ids (integers ≥ 0), got "
                                 f"{ids!r}")
        self.trainable_token_indices = {leaf: list(ids) for leaf, ids in rows.items()}

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
                "revision": None, "layers_to_transform": self.layers_to_transform, "layers_pattern": None,
                "trainable_token_indices": self.trainable_token_indices}

    @classmethod
    def from_peft(cls, cfg: dict, where: str = "adapter_config.json", trainable: bool = False) -> "LoraSettings":
        """Settings from a PEFT LoRA config; a field this implementation does not honour is refused by name (with
        ``trainable``, also one that only changes how the adapter trains on)."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("task_type") not in (None, "CAUSAL_LM"):
            raise ValueError(f"{where}: task_type {cfg.get('task_type')!r} is not CAUSAL_LM")
        for key, default in _UNSUPPORTED.items():
            value = cfg.get(key, default)
            if _holds_value(value, default):
                raise ValueError(f"{where}: {key}={value!r} is not supported")
        unknown = sorted(k for k, v in cfg.items() if k not in _KNOWN_FIELDS and _holds_value(v, ""))
        if unknown:
            raise ValueError(f"{where}: PEFT field(s) {', '.join(f'{k}={cfg[k]!r}' for k in unknown)} are not known "
                             "to this version of liger-models, which cannot tell whether they change the adapter's "
                             "output; loading it as plain LoRA could be silently wrong. Merge the adapter with PEFT "
                             "and load the merged model, or check for a newer liger-models")
        for key in _TRAINING_ONLY if trainable else ():
            if _holds_value(cfg.get(key)):
                raise ValueError(f"{where}: {key}={cfg[key]!r} changes how PEFT trains this adapter, which training "
                                 "here does not do (its gradients would differ from PEFT's): load the adapter with "
                                 "trainable=False (its output is plain LoRA's), or train it on with PEFT")
        init = cfg.get("init_lora_weights", True)
        init_name = init.lower() if isinstance(init, str) else ""
        if init_name.startswith(_BASE_REWRITING_INITS):
            raise ValueError(f"{where}: init_lora_weights={init!r} rewrites the base weights (PEFT subtracts the "
                             "initial adapter from them, also when it loads the adapter), so this adapter does not "
                             "apply to the checkpoint as stored: convert it to a plain LoRA adapter with PEFT "
                             "(save_pretrained(..., path_initial_model_for_weight_conversion=...)), or merge it "
                             "with PEFT and load the merged model")
        if trainable and init_name in _B_FROZEN_INITS:
            raise ValueError(f"{where}: init_lora_weights={init!r} trains lora_A alone (PEFT keeps lora_B frozen), "
                             "which training here does not honour: load the adapter with trainable=False (its "
                             "logits and merge are plain LoRA's), or train it on with PEFT")
        if cfg.get("layers_pattern") not in (None, "", [], "layers", ["layers"]):
            raise ValueError(f"{where}: layers_pattern={cfg['layers_pattern']!r} is not supported (the decoder "
                             "layers here are model.layers.<index>: 'layers' or unset)")
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
                   exclude_modules=cfg.get("exclude_modules") or None,
                   layers_to_transform=cfg.get("layers_to_transform"),
                   trainable_token_indices=cfg.get("trainable_token_indices"))


def _indices(value) -> bool:
    """Whether ``value`` is a list (or tuple) of integers ≥ 0: layer indices, token ids."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)


def parse_indices(text: str, kind: str = "layer") -> list[int]:
    """Indices (decoder layers, token ids: ``kind``) from a comma-separated list of indices and inclusive ranges:
    "0-7,12" → 0…7, 12."""
    indices = set()
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise ValueError(f"{kind}s {text!r}: {part!r} is not a {kind} index or a range of them (such as 0-7)")
        first = int(match.group(1))
        indices.update(range(first, int(match.group(2) or first) + 1))
    return sorted(indices)


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


def resolve_targets(model: nn.Module, targets: list[str] | str, layers: list[int] | None = None) -> list[str]:
    """The full module names that ``targets`` selects (see the module docstring); errors name what exists.
    lm_head and embed_tokens are chosen only by name or pattern, never by all-linear (as PEFT), and are refused when
    the model ties them (one matrix: an adapter merged into it would change both). ``layers``
    (``layers_to_transform``): only the targets inside those decoder layers."""
    linears = decoder_linears(model)
    candidates = {**linears, **outer_modules(model)}
    leaves = sorted({name.rsplit(".", 1)[-1] for name in candidates})
    if targets == ALL_LINEAR:
        return _in_layers(model, list(linears), layers)
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
    return _in_layers(model, chosen, layers)


def layer_index(name: str) -> int | None:
    """The decoder layer a module name is inside (``model.layers.<index>.…``), or None outside the layers."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _in_layers(model: nn.Module, chosen: list[str], layers: list[int] | None) -> list[str]:
    """``chosen`` kept to the decoder layers ``layers`` lists (all of it when None); a layer the model does not have,
    or a chosen module outside the layers, is refused rather than left without an adapter."""
    if layers is None:
        return chosen
    count = model.config.num_hidden_layers
    missing = [i for i in layers if i >= count]
    if missing:
        raise ValueError(f"layers_to_transform names layer {missing[0]}, but this model has {count} decoder layers "
                         f"(0-{count - 1})")
    outside = [name for name in chosen if layer_index(name) is None]
    if outside:
        raise ValueError(f"LoRA on {', '.join(outside)} with layers_to_transform {layers}: it is outside the decoder "
                         "layers, so layers_to_transform would leave it without an adapter; adapt it in a separate "
                         "adapter, or drop layers_to_transform")
    return [name for name in chosen if layer_index(name) in layers]


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
    if chosen and settings.layers_to_transform is not None:
        raise ValueError(f"layers_to_transform {settings.layers_to_transform} with LoRA on the mixture-of-experts "
                         f"parameters ({sorted(chosen)[0]}, …): PEFT's target_parameters adapt every layer, so an "
                         f"adapter saved so would not load as trained; name the attention projections as targets "
                         f"instead of {ALL_LINEAR!r}, or drop layers_to_transform")
    return [routers[k] for k in routers if k in chosen], [k for k in stacks if k in chosen]
