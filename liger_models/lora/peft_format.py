"""Adapters on disk in PEFT's format, and merged HF checkpoints.

``adapter_model.safetensors`` keys are PEFT's: ``base_model.model.<HF module name>.lora_A.weight`` [r, in] and
``….lora_B.weight`` [out, r], and under DoRA ``….lora_magnitude_vector`` [out]; ``adapter_config.json`` carries r,
lora_alpha, target_modules (leaf names), use_rslora, use_dora, rank_pattern / alpha_pattern. Phi3's packed qkv_proj /
gate_up_proj are PEFT's module names too, so the packing never leaks into the files. An adapter on the embedding table
is ``….embed_tokens.lora_embedding_A`` [r, vocab] and ``….lora_embedding_B`` [hidden, r]. PEFT also writes the
embedding layers' own tables where an adapter targets them (``….embed_tokens.base_layer.weight``, for a vocabulary
resized before training); reading takes them into the base, as PEFT does. Writing leaves them out: the base here is
the one the adapter names. Adapters are written in their
own dtype (fp32 unless chosen otherwise).

A decoder loaded from a multimodal checkpoint (Gemma 3 4B-27B, liger_models/wrapped_checkpoint.py) saves its adapter
for transformers' multimodal model: keys under that model's module names (``model.language_model.layers.…``) and
``exclude_modules`` keeping PEFT off the vision tower, whose attention linears share the decoder's leaf names.
Reading takes keys of either multimodal layout onto the decoder; adapters on the vision tower are refused.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from liger_models import atomic
from liger_models.hub import ADAPTER_CONFIG, save_state_dict
from liger_models.modules.lora_embedding import LoraEmbedding
from liger_models.modules.lora_experts import LoraExperts
from liger_models.modules.lora_linear import LoraLinear
from liger_models.modules.moe import STACKS, Experts
from liger_models.wrapped_checkpoint import NOT_DECODER, decoder_name, module_name

from .attach import TOKEN_ROWS, add_lora, lora_adapted, lora_modules, lora_state_dict, restored_on_error
from .config import ROUTER_WEIGHT, LoraSettings, moe_blocks, modules_to_save
from .per_expert_adapters import convert_per_expert

PREFIX = "base_model.model."
CONFIG_NAME, WEIGHTS_NAME = ADAPTER_CONFIG, "adapter_model.safetensors"
# What an adapter's own tensors' keys end with (LoRA A / B of a linear or of the embedding table, DoRA's magnitude).
_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")
_MAGNITUDE = ".lora_magnitude_vector"
_VELORA_PROJECTION = ".lora_velora_embed"  # PEFT's VeLoRA: the vector its backward projects activations on
_BASE_TABLE = ".base_layer.weight"  # PEFT's save_embedding_layers: a targeted embedding's or lm_head's own weight
_TABLES = ("embed_tokens", "lm_head")


def save_adapter(model: nn.Module, directory: str | Path, base_model: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors that HF + PEFT's ``PeftModel.from_pretrained`` loads."""
    settings: LoraSettings | None = getattr(model, "lora_settings", None)
    modules = lora_modules(model)
    if settings is None or not modules:
        raise ValueError("the model has no LoRA adapters to save (liger_models.lora.add_lora first)")
    if any(m.merged for m in modules.values()):
        raise ValueError("the adapters are merged into the base weights: unmerge before saving them")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    wrapped = getattr(model, "checkpoint_wrapper", None) is not None
    tensors = {PREFIX + (module_name(k) if wrapped else k): v.detach().to("cpu", copy=True).contiguous()
               for k, v in lora_state_dict(model).items()}
    # Each file is written whole under a temporary name and renamed into place: a save killed midway leaves the
    # previous adapter's file, never a truncated one.
    atomic.write_file(directory / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    routers = set(modules) & _routers(model)
    experts = [m for m in modules.values() if isinstance(m, LoraExperts)]
    leaves = sorted({name.rsplit(".", 1)[-1] for name, m in lora_adapted(modules).items()
                     if name not in routers and not isinstance(m, LoraExperts)})
    parameters = sorted({stack for m in experts for stack in m.lora} | ({ROUTER_WEIGHT} if routers else set()))
    config = settings.to_peft(leaves, base_model, parameters)
    if wrapped:
        config["exclude_modules"] = NOT_DECODER
    atomic.write_text(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def read_adapter(directory: str | Path, trainable: bool = False) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """(settings, our-name → tensor) of a PEFT LoRA adapter directory (``trainable``: to train on, which refuses
    what only changes how it trains, LoraSettings.from_peft)."""
    directory = Path(directory)
    cfg_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"{str(p)!r} not found: an adapter directory holds {CONFIG_NAME} and "
                                    f"{WEIGHTS_NAME}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(cfg_path)!r}: not valid JSON ({e})") from e
    settings = LoraSettings.from_peft(cfg, str(cfg_path), trainable)
    velora = bool(cfg.get("velora_config"))  # from_peft has refused it for training on
    tensors = {}
    for key, value in load_file(str(weights_path)).items():
        if not key.startswith(PREFIX):
            raise ValueError(f"{str(weights_path)!r}: key {key!r} does not start with {PREFIX!r}")
        try:  # an adapter for a multimodal model's decoder: its keys onto the decoder's own names
            name = decoder_name(key[len(PREFIX):])
        except ValueError as e:
            raise ValueError(f"{str(weights_path)!r}: {e}") from e
        if velora and name.endswith(_VELORA_PROJECTION):
            continue  # VeLoRA's activation projection, used only in PEFT's backward of A
        whole = name.endswith(".weight") and name[:-len(".weight")].rsplit(".", 1)[-1] in settings.modules_to_save
        magnitude = name.endswith(_MAGNITUDE)
        if magnitude and not settings.use_dora:
            raise ValueError(f"{str(weights_path)!r}: {key!r} is a DoRA magnitude, but {CONFIG_NAME} does not set "
                             "use_dora")
        table = name.endswith(_BASE_TABLE) and name[:-len(_BASE_TABLE)].rsplit(".", 1)[-1] in _TABLES
        rows = name.endswith(TOKEN_ROWS) and name[:-len(TOKEN_ROWS)].rsplit(".", 1)[-1] in (
            settings.trainable_token_indices or {})
        if not (whole or magnitude or table or rows or name.endswith(_ADAPTER_SUFFIXES)):
            raise ValueError(f"{str(weights_path)!r}: {key!r} is neither a LoRA A/B weight, a DoRA magnitude, "
                             f"rows of trainable_token_indices nor one of modules_to_save {settings.modules_to_save}")
        tensors[name] = value
    return settings, tensors


def load_adapter(model: nn.Module, directory: str | Path, trainable: bool = False) -> list[str]:
    """Attach the PEFT adapter in ``directory`` to ``model``: same modules, ranks and scales; shapes must match the
    base (an adapter for another model is refused naming the first mismatch). Returns the adapted names."""
    settings, tensors = read_adapter(directory, trainable)
    blocks = moe_blocks(model)
    if blocks:  # an adapter saved against transformers v4's per-expert linears: in the stacked layout
        settings, tensors = convert_per_expert(settings, tensors, next(iter(blocks.values())).num_experts,
                                               str(directory))
    # PEFT nests one wrapper per adapted expert stack: "experts.base_layer.lora_A" is the experts' too.
    wanted = sorted({_module_of(k).replace(".base_layer", "") for k in tensors if k.endswith(_ADAPTER_SUFFIXES)})
    # A refused adapter leaves the model as it was: no fresh adapters attached, its base not frozen. Everything is
    # checked (and the new adapter tensors filled) first; the base's own weights are written only after.
    with restored_on_error(model):
        # The files say which modules carry adapters (target_modules may be a pattern or a superset of them).
        names = add_lora(model, settings)
        base_writes = _fill_adapters(model, names, wanted, settings, tensors, directory, trainable)
    with torch.no_grad():
        for write in base_writes:
            write()
    return names


@torch.no_grad()
def _fill_adapters(model: nn.Module, names: list[str], wanted: list[str], settings: LoraSettings,
                   tensors: dict[str, torch.Tensor], directory, trainable: bool) -> list:
    """Copy the file's adapter tensors into the adapters just attached, checking every shape; returns the writes
    into the base's own weights (a resized table, modules_to_save) as closures, none done yet."""
    modules = lora_modules(model)
    excluded = [n for n in names if _excluded(settings.exclude_modules, n)]
    if excluded:
        raise ValueError(f"{directory}: exclude_modules {settings.exclude_modules!r} excludes {excluded[0]!r}, which "
                         "target_modules selects (excluding decoder modules is not supported)")
    missing = [n for n in names if not any(f"{n}{suffix}" in tensors for suffix in _ADAPTER_SUFFIXES)]
    tables = [k[:-len(_BASE_TABLE)] for k in tensors if k.endswith(_BASE_TABLE)]
    unknown = [n for n in wanted + tables if n not in modules]
    if unknown:
        raise ValueError(f"{directory}: adapter for {unknown[0]!r}, which this model does not have or target")
    if missing:
        raise ValueError(f"{directory}: no adapter weights for {missing[0]!r}, which target_modules selects")
    writes = []
    for name, m in modules.items():
        for suffix, dst in m.adapter_tensors().items():
            key = f"{name}.{suffix}"
            src = tensors.get(key)
            what = (f"{key} (DoRA)" if key.endswith(_MAGNITUDE) else
                    f"trainable_token_indices of {name}" if key.endswith(TOKEN_ROWS) else None)
            if what is not None and (src is None or tuple(src.shape) != tuple(dst.shape)):
                raise ValueError(f"{directory}: {what} needs shape {tuple(dst.shape)}, the file has "
                                 f"{'none' if src is None else tuple(src.shape)}")
            if src is None:
                raise ValueError(f"{directory}: {key} is missing")
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{directory}: {key} has shape {tuple(src.shape)}, but this model needs "
                                 f"{tuple(dst.shape)} (an adapter for a different base model?)")
            dst.copy_(src)
            dst.requires_grad_(trainable)
        table = tensors.get(f"{name}{_BASE_TABLE}")
        if table is not None:
            if tuple(table.shape) != tuple(m.weight.shape):
                raise ValueError(f"{directory}: {name}{_BASE_TABLE} has shape {tuple(table.shape)}, this model's "
                                 f"{name} {tuple(m.weight.shape)} (a resized vocabulary needs the base resized "
                                 "first)")
            writes.append(lambda m=m, table=table: m.weight.copy_(table))
    for name, module in modules_to_save(model, settings.modules_to_save).items():
        src = tensors.get(f"{name}.weight")
        if src is None or tuple(src.shape) != tuple(module.weight.shape):
            raise ValueError(f"{directory}: modules_to_save {name!r} needs a weight of shape "
                             f"{tuple(module.weight.shape)}, the file has "
                             f"{'none' if src is None else tuple(src.shape)}")
        module.weight.requires_grad_(trainable)
        writes.append(lambda module=module, src=src: module.weight.copy_(src))
    return writes


@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors with every adapter merged: W + s·B·A (times m / n per row under DoRA) in fp32, rounded once
    to ``dtype`` (default: the base weight's; for an NF4 base, from dequant(NF4), what the adapter trained against,
    in the compute dtype)."""
    adapters = lora_modules(model)
    own = {id(p) for m in adapters.values() for p in m.adapter_tensors().values()}
    own_names = {n for n, p in model.named_parameters() if id(p) in own}
    # The routers and expert stacks of mixture-of-experts blocks go to disk under the family's names (Mixtral's
    # block_sparse_moe.…, one tensor per expert), which the layers' state-dict hooks write: their merged weights
    # stand in for the Parameters while the state dict is taken.
    # NF4 expert stacks (QLoRA), adapted or not, are written dequantised the same way.
    routers = _routers(model)
    moe = {name: m for name, m in adapters.items() if isinstance(m, LoraExperts) or name in routers}
    moe.update({name: m for name, m in model.named_modules() if isinstance(m, Experts) and m.nf4})
    with _merged_in_place(moe, dtype):
        state = {key: value for key, value in model.state_dict().items() if key not in own_names}
    for name, m in model.named_modules():
        if name in moe:
            continue
        if isinstance(m, LoraLinear):
            base = m.base_weight(torch.float32) if m.quant is not None else m.weight.float()
            out_dtype = dtype or (m.quant.dtype if m.quant is not None else m.weight.dtype)
        elif isinstance(m, LoraEmbedding):
            base, out_dtype = m.weight.float(), dtype or m.weight.dtype
        else:
            continue
        w = m.merged_weight() if (name in adapters and not m.merged) else base
        state[f"{name}.weight"] = w.to(out_dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


@contextlib.contextmanager
def _merged_in_place(modules: dict[str, nn.Module], dtype: torch.dtype | None):
    """Within: each module's adapted Parameters (a router's weight, the experts' stacks) replaced by new ones
    holding the merged weights in ``dtype`` (default their own); the originals are put back untouched after."""
    swapped = []
    for m in modules.values():
        if getattr(m, "merged", False):  # the Parameters hold the merged weights already
            continue
        if isinstance(m, LoraLinear):
            merged = {"weight": (m.merged_weight(), m.weight.dtype)}
        else:  # experts: adapted stacks merged, NF4 ones dequantised (in their compute dtype)
            adapted = m.lora if isinstance(m, LoraExperts) else {}
            merged = {stack: (m.merged_weight(stack) if stack in adapted else m.dense_stack(stack, torch.float32),
                              m.nf4[stack].dtype if stack in m.nf4 else getattr(m, stack).dtype)
                      for stack in STACKS if stack in adapted or stack in m.nf4}
        for attr, (weight, own_dtype) in merged.items():
            swapped.append((m, attr, getattr(m, attr)))
            setattr(m, attr, nn.Parameter(weight.to(dtype or own_dtype), requires_grad=False))
    try:
        yield
    finally:
        for m, attr, original in reversed(swapped):
            setattr(m, attr, original)


def _routers(model: nn.Module) -> set[str]:
    """The names of the mixture-of-experts blocks' routers (each block's ``gate`` beside its ``experts``)."""
    return {f"{block}.gate" for block in moe_blocks(model)}


def _excluded(exclude: str | list[str] | None, name: str) -> bool:
    """Whether PEFT's ``exclude_modules`` excludes decoder module ``name`` (as a plain decoder's module or as a
    multimodal model's): a string is a regex matched in full, a list names modules or the ends of their names."""
    if not exclude:
        return False
    names = (name, module_name(name))
    if isinstance(exclude, str):
        return any(re.fullmatch(exclude, n) for n in names)
    return any(n == e or n.endswith("." + e) for n in names for e in exclude)


def _module_of(key: str) -> str:
    """The module name of an adapter tensor's key."""
    for suffix in _ADAPTER_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    raise ValueError(key)


def save_merged(model: nn.Module, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """A plain HF checkpoint (config.json + safetensors) with the adapters merged, that transformers loads."""
    save_state_dict(merged_state_dict(model, dtype), model.config, directory,
                    generation_config=getattr(model, "generation_config", None),
                    wrapper=getattr(model, "checkpoint_wrapper", None))
