"""Mixture-of-experts adapters saved against transformers v4's per-expert linears, read into the stacked layout.

Before transformers v5 stacked the experts, PEFT adapted each expert's linears as modules of their own:
``….block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` (Mixtral's gate / up / down) or
``….mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen3-MoE), and Mixtral's router as
``….block_sparse_moe.gate``. Most MoE adapters on the Hub are such files. They are the same math as the stacked
layout of modules/lora_experts.py:
  * gate and up (rank r each) become one adapter of rank 2r on the gate|up stack: A_e = [A_gate; A_up] (2r, D),
    B_e = the block diagonal of B_gate and B_up (2I, 2r); at alpha 2·alpha the scale alpha/r is unchanged (PEFT
    converts them the same way; under rsLoRA alpha·√2 keeps alpha/√r, where PEFT's 2·alpha would not);
  * down keeps rank r;
  * the router's adapter moves to the block's name in memory (``mlp.gate``).
A file that adapts gate without up (or the reverse), or not every expert of a block, is refused: the stacked
layout has one adapter per stack.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from liger_models.modules.lora_experts import peft_prefixes

from .config import FUSED_GATE_UP_FACTOR, FUSED_GATE_UP_PATTERN, ROUTER_WEIGHT, LoraSettings

# A per-expert adapter tensor: (layer prefix, expert, linear, lora_A / lora_B).
_PER_EXPERT = re.compile(r"^(.*\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(lora_A|lora_B)\.weight$")
_ROUTER = re.compile(r"^(.*\.layers\.\d+)\.block_sparse_moe\.gate\.(lora_A|lora_B)\.weight$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_LEAVES = set(_ROLE) | {"gate"}


def convert_per_expert(settings: LoraSettings, tensors: dict[str, torch.Tensor], num_experts: int,
                       where: str) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """(settings, tensors) of a v4 per-expert adapter in the stacked layout; unchanged when the file has none."""
    per_layer: dict[str, dict] = {}
    routers = {}
    rest = {}
    for key, value in tensors.items():
        if m := _PER_EXPERT.match(key):
            per_layer.setdefault(m[1], {}).setdefault(_ROLE[m[3]], {})[(int(m[2]), m[4])] = value
        elif m := _ROUTER.match(key):
            routers[f"{m[1]}.mlp.gate.{m[2]}.weight"] = value
        else:
            rest[key] = value
    if not per_layer and not routers:
        return settings, tensors
    stacks = set()
    for layer, roles in per_layer.items():
        if ("gate" in roles) != ("up" in roles):
            raise ValueError(f"{where}: {layer} adapts the experts' {'gate' if 'gate' in roles else 'up'} "
                             "projections without the other; their stacked gate|up weight takes one adapter")
        for role, parts in roles.items():
            experts = sorted({e for e, _ in parts})
            if experts != list(range(num_experts)) or len(parts) != 2 * num_experts:
                raise ValueError(f"{where}: {layer} has {role} adapters for experts {experts} (with A and B each), "
                                 f"not for all {num_experts} of this model")
        adapted = {"gate_up_proj"} if "gate" in roles else set()
        adapted |= {"down_proj"} if "down" in roles else set()
        stacks |= adapted
        for stack, nesting in peft_prefixes(adapted).items():
            a, b = (_fused(roles["gate"], roles["up"], num_experts) if stack == "gate_up_proj"
                    else _stacked(roles["down"], num_experts))
            prefix = f"{layer}.mlp.experts.{nesting}"
            rest[prefix + "lora_A.weight"], rest[prefix + "lora_B.weight"] = a, b
    rest.update(routers)
    targets = settings.targets
    if not isinstance(targets, str):
        targets = [t for t in targets if t not in _LEAVES]
    parameters = sorted(set(settings.target_parameters) | stacks | ({ROUTER_WEIGHT} if routers else set()))
    rank, alpha = dict(settings.rank_pattern), dict(settings.alpha_pattern)
    if "gate_up_proj" in stacks:
        rank[FUSED_GATE_UP_PATTERN] = settings.r * FUSED_GATE_UP_FACTOR
        factor = math.sqrt(FUSED_GATE_UP_FACTOR) if settings.use_rslora else FUSED_GATE_UP_FACTOR
        alpha[FUSED_GATE_UP_PATTERN] = settings.alpha * factor
    converted = dataclasses.replace(settings, targets=targets, rank_pattern=rank, alpha_pattern=alpha,
                                    target_parameters=parameters)
    return converted, rest


def _stacked(parts: dict, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's stacked layout of per-expert A (r, in) and B (out, r): A rows e·r…, B column j·E + e."""
    a = torch.cat([parts[(e, "lora_A")] for e in range(num_experts)])
    b = torch.stack([parts[(e, "lora_B")] for e in range(num_experts)], dim=-1)  # (out, r, E)
    return a, b.reshape(b.shape[0], -1)


def _fused(gate: dict, up: dict, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's gate and up adapters as one of twice the rank on the gate|up rows (module docstring)."""
    fused = {}
    for e in range(num_experts):
        a_g, a_u, b_g, b_u = gate[(e, "lora_A")], up[(e, "lora_A")], gate[(e, "lora_B")], up[(e, "lora_B")]
        fused[(e, "lora_A")] = torch.cat([a_g, a_u])
        fused[(e, "lora_B")] = torch.block_diag(b_g, b_u)
    return _stacked(fused, num_experts)
