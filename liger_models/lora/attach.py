"""Put adapters on a model, freeze its base, merge and unmerge them, quantise the base to NF4."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from liger_models.kernels.ops.nf4 import dequantize_absmax, double_quantize, quantize_nf4
from liger_models.modules.lora_embedding import LoraEmbedding
from liger_models.modules.lora_experts import LoraExperts
from liger_models.modules.lora_linear import LoraLinear, NF4Weight
from liger_models.modules.token_rows import ADAPTER_KEY

from .config import (ALL_LINEAR, FUSED_GATE_UP_FACTOR, FUSED_GATE_UP_PATTERN, LoraSettings, decoder_linears,
                     modules_to_save, moe_blocks, outer_modules, pattern_value, resolve_parameters, resolve_targets)

# PEFT's key suffix for the rows trainable_token_indices replaces: [len(ids), hidden], the rows' new values.
TOKEN_ROWS = f".{ADAPTER_KEY}"


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


@contextlib.contextmanager
def restored_on_error(model: nn.Module):
    """Within: an exception puts the model's module tree back as it was (every module's attributes, submodules,
    parameters, buffers and hooks, each parameter's requires_grad), then propagates. Weights are not copied: what
    runs inside must not write into existing tensors."""
    saved = []
    for m in model.modules():
        attrs = dict(m.__dict__)
        saved.append((m, attrs, {k: dict(v) for k, v in attrs.items() if isinstance(v, dict)}))
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    except BaseException:
        for m, attrs, contents in saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            for key, items in contents.items():
                attrs[key].clear()
                attrs[key].update(items)
        for p, flag in flags:
            p.requires_grad_(flag)
        raise


def lora_modules(model: nn.Module) -> dict[str, LoraLinear | LoraEmbedding | LoraExperts]:
    """Full name → LoraLinear, LoraEmbedding or LoraExperts that carries an adapter or its own trainable-token rows
    (a tied lm_head reads the embedding's and is not listed)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (LoraLinear, LoraEmbedding, LoraExperts)) and m.carries_adapter}


def lora_adapted(modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Those of ``lora_modules``' that carry a LoRA adapter (not only token rows)."""
    return {name: m for name, m in modules.items()
            if getattr(m, "lora_A", None) is not None or getattr(m, "lora_embedding_A", None) is not None}


def _with_fused_gate_up(settings: LoraSettings, stacks: list[str]) -> LoraSettings:
    """all-linear's rank and alpha for the experts' gate|up stacks (config.py's docstring), written into the
    patterns as PEFT writes them, unless the patterns already name those stacks."""
    gate_up = [s for s in stacks if s.endswith(".gate_up_proj")]
    if settings.targets != ALL_LINEAR or not gate_up:
        return settings
    rank, alpha = dict(settings.rank_pattern), dict(settings.alpha_pattern)
    if pattern_value(rank, gate_up[0], None) is None:
        rank[FUSED_GATE_UP_PATTERN] = settings.r * FUSED_GATE_UP_FACTOR
    if pattern_value(alpha, gate_up[0], None) is None:
        alpha[FUSED_GATE_UP_PATTERN] = settings.alpha * FUSED_GATE_UP_FACTOR
    return dataclasses.replace(settings, rank_pattern=rank, alpha_pattern=alpha)


def add_lora(model: nn.Module, settings: LoraSettings, dtype: torch.dtype = torch.float32) -> list[str]:
    """Adapters on the targeted linears (fresh A, B = 0 unless settings.init is False) and settings.modules_to_save
    trainable whole; every other parameter is frozen. Returns the adapted module names. Adapters are kept in
    ``dtype`` (fp32 by default, as PEFT: the optimizer updates them in full precision; they are cast to the
    activations' dtype inside the GEMMs)."""
    names = resolve_targets(model, settings.targets, settings.layers_to_transform)
    routers, stacks = resolve_parameters(model, settings)
    if (routers or stacks) and (settings.dropout or settings.use_dora):
        raise ValueError(f"LoRA on the mixture-of-experts parameters ({(routers + stacks)[0]}, …) takes neither "
                         f"dropout nor DoRA (PEFT's target_parameters refuses both): set lora dropout to 0 and "
                         f"use_dora off, or name the attention projections as targets instead of {ALL_LINEAR!r}")
    settings = _with_fused_gate_up(settings, stacks)
    whole = modules_to_save(model, settings.modules_to_save)
    both = sorted(set(names) & set(whole))
    if both:
        raise ValueError(f"{', '.join(both)}: both a LoRA target and in modules_to_save; choose one")
    tables = [name for name in names if isinstance(model.get_submodule(name), (nn.Embedding, LoraEmbedding))]
    if settings.use_dora and tables:
        raise ValueError(f"DoRA on the embedding table ({', '.join(tables)}) is not supported; DoRA adapts linears")
    rows = token_rows(model, settings.trainable_token_indices)
    adapted_too = sorted(set(rows) & set(names))
    if adapted_too:
        raise ValueError(f"{', '.join(adapted_too)}: both a LoRA target and in trainable_token_indices; a table "
                         "takes one or the other (as in PEFT)")
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters (merge or remove them first)")
    with restored_on_error(model):  # a module that cannot take an adapter leaves the model as it was
        _attach(model, settings, names, routers, stacks, whole, rows, dtype)
    names = names + routers + sorted({s.rpartition(".")[0] for s in stacks})
    model.lora_settings = settings
    return names


def _attach(model: nn.Module, settings: LoraSettings, names: list[str], routers: list[str], stacks: list[str],
            whole: dict[str, nn.Module], rows: dict[str, tuple[nn.Module, list[int]]], dtype: torch.dtype) -> None:
    """add_lora's changes to the model, once its checks have passed: base frozen, adapters in place."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        r, alpha = settings.rank_and_alpha(name)
        target = model.get_submodule(name)
        if isinstance(target, (nn.Embedding, LoraEmbedding)):
            module = LoraEmbedding.from_embedding(target)
            module.add_adapter(r, alpha, settings.use_rslora, settings.init, dtype)
        else:
            module = LoraLinear.from_linear(target)
            module.add_adapter(r, alpha, settings.dropout, settings.use_rslora, settings.init, dtype,
                               settings.use_dora)
        module.train(model.training)
        _replace(model, name, module)
    for name in routers:  # PEFT's key for a router is its weight's name (target_parameters "gate.weight")
        r, alpha = settings.rank_and_alpha(f"{name}.weight")
        module = LoraLinear.from_linear(model.get_submodule(name))
        module.add_adapter(r, alpha, 0.0, settings.use_rslora, settings.init, dtype)
        module.train(model.training)
        _replace(model, name, module)
    for name in stacks:
        experts_name, _, stack = name.rpartition(".")
        module = LoraExperts.from_experts(model.get_submodule(experts_name))
        r, alpha = settings.rank_and_alpha(name)
        module.add_adapter(stack, r, alpha, settings.use_rslora, settings.init, dtype)
        module.train(model.training)
        _replace(model, experts_name, module)
    _attach_token_rows(model, rows, settings.init, dtype)
    model.pack_()  # the replaced linears keep their packed Parameters; re-register the state-dict copies
    for module in whole.values():
        module.weight.requires_grad_(True)


def _attach_token_rows(model: nn.Module, rows: dict[str, tuple[nn.Module, list[int]]], init: str | bool,
                       dtype: torch.dtype) -> None:
    """Trainable-token rows on the tables ``token_rows`` found; on a tied model lm_head reads the embedding's."""
    for name, (table, ids) in rows.items():
        embedding = isinstance(table, (nn.Embedding, LoraEmbedding))
        module = LoraEmbedding.from_embedding(table) if embedding else LoraLinear.from_linear(table)
        module.add_token_rows(ids, dtype, init)
        module.train(model.training)
        _replace(model, name, module)
        if embedding and _tied(model):
            head = LoraLinear.from_linear(model.lm_head)
            head.add_token_rows(ids, tied=module.token_adapter)
            head.train(model.training)
            model.lm_head = head


def _tied(model: nn.Module) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our-name → tensor of what the adapter trains, under PEFT's key names: each A and B
    (``model.layers.0.self_attn.q_proj.lora_A.weight`` …; ``model.embed_tokens.lora_embedding_A`` …), each DoRA
    magnitude (``….q_proj.lora_magnitude_vector``), trainable-token rows (``model.embed_tokens`` +
    ``TOKEN_ROWS``) and the whole weight of each of its modules_to_save (``lm_head.weight``)."""
    out = {}
    for name, m in lora_modules(model).items():
        out.update({f"{name}.{suffix}": p for suffix, p in m.adapter_tensors().items()})
    settings = getattr(model, "lora_settings", None)
    for name, module in modules_to_save(model, settings.modules_to_save if settings else []).items():
        out[f"{name}.weight"] = module.weight
    return out


def token_rows(model: nn.Module, indices: dict[str, list[int]] | None) -> dict[str, tuple[nn.Module, list[int]]]:
    """Full name → (table module, row ids) for PEFT's trainable_token_indices ({leaf: ids}). On a tied model, lm_head
    named with the embedding's very ids is the embedding's rows, which the head shares (PEFT ties the two and saves
    the embedding's alone). Refused: ids past the table, and on a tied model other rows for lm_head (PEFT then gives
    the head rows its embedding does not have, which no merged or tied checkpoint can hold)."""
    found = {}
    tables = outer_modules(model)
    if indices and "lm_head" in indices and _tied(model):
        if indices["lm_head"] != indices.get("embed_tokens"):
            raise ValueError(f"trainable_token_indices names lm_head {indices['lm_head']}, but this model ties it to "
                             f"embed_tokens (one matrix) with rows {indices.get('embed_tokens', [])}: give the rows "
                             "for embed_tokens (a list), which the tied lm_head shares")
        indices = {leaf: ids for leaf, ids in indices.items() if leaf != "lm_head"}
    for leaf, ids in (indices or {}).items():
        name = next((n for n in tables if n.rsplit(".", 1)[-1] == leaf), None)
        if name is None:
            raise ValueError(f"trainable_token_indices: this model has no {leaf}")
        module = tables[name]
        rows = module.weight.shape[0]
        if max(ids) >= rows:
            raise ValueError(f"trainable_token_indices[{leaf!r}] names token {max(ids)}, but {name} has {rows} rows")
        found[name] = (module, list(ids))
    return found


def merge_lora(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.merge()


def unmerge_lora(model: nn.Module) -> None:
    for m in lora_modules(model).values():
        m.unmerge()


def nf4_weight(weight: torch.Tensor) -> NF4Weight:
    """``weight`` (any shape, row-major) in NF4 with double quantisation, bitsandbytes' codes; the block scales are
    the double-quantised ones, expanded to fp32."""
    codes, absmax = quantize_nf4(weight)
    dq = double_quantize(absmax)
    absmax = dequantize_absmax(dq["absmax"], dq["nested_absmax"], dq["nested_quant_map"], dq["nested_offset"])
    return NF4Weight(codes, absmax, tuple(weight.shape), weight.dtype)


@torch.no_grad()
def quantize_base_(model: nn.Module, skip: tuple[str, ...] = (), device: torch.device | str | None = None) -> list[str]:
    """Every decoder linear (not embeddings, norms, routers or lm_head, as transformers' bitsandbytes path) and
    every mixture-of-experts stack (``experts.gate_up_proj`` / ``down_proj``, which transformers' bitsandbytes path
    leaves dense: they are most of such a model's weights) to NF4 with double quantisation, bitsandbytes' codes; the
    block scales are the double-quantised ones, expanded to fp32. Modules whose name contains an entry of ``skip``
    stay dense. ``device``: where the NF4 weights are made and kept, each dense weight sent there first (the rest of
    the model stays where it is); default, where each weight is. Returns the quantised names."""
    def quantised(weight: torch.Tensor) -> NF4Weight:
        return nf4_weight(weight if device is None else weight.to(device))

    done = []
    for name, lin in decoder_linears(model).items():
        if any(s in name for s in skip) or (isinstance(lin, LoraLinear) and lin.quant is not None):
            continue
        quant = quantised(lin.weight)
        bias = lin.bias
        if bias is not None:
            bias = nn.Parameter(bias.detach().to(device=quant.codes.device, copy=True), requires_grad=False)
        new = LoraLinear(lin.in_features, lin.out_features, None, bias, quant=quant)
        if isinstance(lin, LoraLinear) and lin.lora_A is not None:
            new.lora_A, new.lora_B, new.lora_magnitude_vector = lin.lora_A, lin.lora_B, lin.lora_magnitude_vector
            new.r, new.lora_alpha, new.scaling, new.lora_dropout = lin.r, lin.lora_alpha, lin.scaling, lin.lora_dropout
        new.train(lin.training)
        _replace(model, name, new)
        done.append(name)
    for block in moe_blocks(model):
        name = f"{block}.experts"
        if not any(s in name for s in skip):
            done += [f"{name}.{stack}" for stack in model.get_submodule(name).quantize_(quantised)]
    return done
