"""LoRA on the stacked expert weights of a mixture-of-experts block (Mixtral, Qwen3-MoE), in PEFT's layout.

``LoraExperts`` replaces a block's ``experts`` (moe.py's ``Experts``) under the same name and keeps its stacked
Parameters ``gate_up_proj`` (E, 2I, D) and ``down_proj`` (E, D, I). Each of them may carry one adapter, as PEFT's
``target_parameters`` (its ``ParamWrapper``) lays one out for transformers' stacked experts:
``lora_A`` [E·r, in] and ``lora_B`` [out, E·r], expert e's factors A_e = lora_A[e·r:(e+1)·r] and
B_e = lora_B[:, e::E] (PEFT reshapes B to (out, r, E)), so that expert e computes
W_e·x + s·B_e·A_e·x, s = alpha/r (alpha/√r rsLoRA). No dropout and no DoRA: PEFT refuses both on a parameter.

PEFT wraps every targeted parameter of one module in its own ``ParamWrapper``, nested in the module's parameter
order, so the adapter of the first one (``gate_up_proj`` when both are targeted) is saved under
``experts.base_layer.lora_A.weight`` and the last one's under ``experts.lora_A.weight``; ``adapter_tensors`` gives
those names.

The adapters run inside the grouped expert GEMMs (moe.py's ``_Experts``): per sorted row, u = A_e·x (one grouped
GEMM of width r), then the base output plus s·B_e·u (one more); backward transposes them. W_e + s·B_e·A_e is never
formed, except by ``merge`` and a merged export.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .lora_linear import check_rank
from .moe import STACKS, Experts, ExpertsLora, stack_factors


def peft_prefixes(stacks) -> dict[str, str]:
    """Stack → the prefix of its adapter's keys after the experts' name, for the adapted ``stacks``: PEFT nests one
    wrapper per adapted parameter in STACKS order, the first innermost (``base_layer.`` once per wrapper around
    it)."""
    adapted = [n for n in STACKS if n in stacks]
    return {name: "base_layer." * (len(adapted) - 1 - depth) for depth, name in enumerate(adapted)}


class ExpertsAdapter(nn.Module):
    """One stacked parameter's adapter: ``lora_A`` (E·r, in), ``lora_B`` (out, E·r), PEFT's shapes."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, r: int, alpha: float,
                 use_rslora: bool, device, dtype: torch.dtype) -> None:
        super().__init__()
        check_rank(r)
        self.num_experts, self.r, self.lora_alpha = num_experts, r, float(alpha)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_A = nn.Parameter(torch.empty(num_experts * r, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, num_experts * r, device=device, dtype=dtype))

    @torch.no_grad()
    def reset(self, init: str | bool) -> None:
        """PEFT's initialisation of each expert's A (kaiming-uniform, a = √5, over its in-features; N(0, 1/r) for
        "gaussian") and B = 0; init=False draws B too (a non-zero adapter, for tests)."""
        if init == "gaussian":
            nn.init.normal_(self.lora_A, std=1 / self.r)
        else:
            bound = 1 / math.sqrt(self.lora_A.shape[1])  # kaiming_uniform_(a=√5) of an (r, in) weight
            nn.init.uniform_(self.lora_A, -bound, bound)
        if init is False:
            nn.init.normal_(self.lora_B, std=1 / math.sqrt(self.r))
        else:
            nn.init.zeros_(self.lora_B)

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """s·B_e·A_e for every expert, (E, out, in) in fp32."""
        a, b = stack_factors(self.lora_A, self.lora_B, self.num_experts, torch.float32)
        return self.scaling * torch.bmm(b, a)


class LoraExperts(Experts):
    """The stacked experts with an adapter on ``gate_up_proj``, ``down_proj`` or both (``lora``, by name)."""

    def __init__(self, experts: Experts) -> None:
        nn.Module.__init__(self)
        for name in STACKS:  # the same Parameters (None where the stack is NF4), and the same NF4 stacks
            self.register_parameter(name, getattr(experts, name))
        self.nf4 = experts.nf4
        self.lora = nn.ModuleDict()
        self.merged = False

    @classmethod
    def from_experts(cls, experts: Experts) -> "LoraExperts":
        return experts if isinstance(experts, LoraExperts) else cls(experts)

    def add_adapter(self, name: str, r: int, alpha: float, use_rslora: bool = False, init: str | bool = True,
                    dtype: torch.dtype = torch.float32) -> None:
        if name not in STACKS:
            raise ValueError(f"experts take adapters on {' and '.join(STACKS)}, not {name!r}")
        stack = self.stack(name)
        experts, out_features, in_features = stack.shape
        device = stack.codes.device if name in self.nf4 else stack.device
        adapter = ExpertsAdapter(experts, in_features, out_features, r, alpha, use_rslora, device, dtype)
        adapter.reset(init)
        self.lora[name] = adapter

    @property
    def lora_A(self):  # what lora_modules() asks of every adapted module: whether an adapter is attached
        return next(iter(self.lora.values())).lora_A if len(self.lora) else None

    @property
    def has_adapter(self) -> bool:
        return len(self.lora) > 0 and not self.merged

    @property
    def carries_adapter(self) -> bool:
        """An adapter is attached, merged into the stacks or not."""
        return len(self.lora) > 0

    def adapters(self) -> ExpertsLora | None:
        """The adapters as the routed experts take them (None while merged)."""
        if not self.has_adapter:
            return None

        def factors(name: str) -> tuple:
            adapter = self.lora[name] if name in self.lora else None
            return (None, None, 0.0) if adapter is None else (adapter.lora_A, adapter.lora_B, adapter.scaling)

        return ExpertsLora(*factors("gate_up_proj"), *factors("down_proj"))

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        """Key suffix → Parameter under PEFT's names (``peft_prefixes``)."""
        out = {}
        for name, prefix in peft_prefixes(self.lora).items():
            out[f"{prefix}lora_A.weight"] = self.lora[name].lora_A
            out[f"{prefix}lora_B.weight"] = self.lora[name].lora_B
        return out

    @torch.no_grad()
    def merged_weight(self, name: str) -> torch.Tensor:
        """W + s·B_e·A_e for every expert, (E, out, in) in fp32 (the base alone where ``name`` has no adapter; an NF4
        base dequantised, what the adapter trained against)."""
        w = self.dense_stack(name, torch.float32)
        return w + self.lora[name].delta() if name in self.lora else w

    @torch.no_grad()
    def merge(self) -> None:
        """Each adapted stack := its merged weight (fp32, rounded once); the adapters add nothing until unmerge."""
        if self.nf4:
            raise ValueError("merging into NF4 experts would re-quantise them; export a merged checkpoint instead "
                             "(liger_models.lora.save_merged)")
        if not self.merged:
            for name in self.lora:
                getattr(self, name).copy_(self.merged_weight(name))
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Each adapted stack := W − s·B·A: exact up to one rounding of W in its dtype."""
        if self.merged:
            for name, adapter in self.lora.items():
                weight = getattr(self, name)
                weight.copy_(weight.float() - adapter.delta())
            self.merged = False

    def extra_repr(self) -> str:
        parts = [f"{n}: r={a.r}, scaling={a.scaling:g}" for n, a in self.lora.items()]
        return "; ".join(parts) + (", merged" if self.merged else "")
