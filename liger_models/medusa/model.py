"""MedusaModel: a base causal LM from the zoo plus K Medusa heads, trained in stage 1 or stage 2.

Stage 1 (Medusa-1): the base is frozen (requires_grad off) and runs under no_grad; only the heads train and the
base CE is dropped (w0 = 0). Stage 2 (Medusa-2): base and heads train jointly with the base CE on (w0 = 1) and the
heads at 4× the learning rate (`param_groups`); a base carrying LoRA adapters (liger_models.lora) trains through
them alone, its own weights frozen, and saves as the heads plus a PEFT adapter of the original base. Either way the base's decoder runs once and every loss term is a
fused linear-cross-entropy on that one hidden-state tensor (see loss.py).

Works with any base exposing `.model(input_ids, position_ids=...) -> final hidden states`, `.lm_head` (bias-free
nn.Linear) and `.config` (hidden_size, vocab_size) — every `Liger<Family>ForCausalLM`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from liger_models.hub import parse_dtype, snapshot
from liger_models.lora import load_adapter, load_causal_lm, lora_modules, lora_state_dict, read_adapter, save_adapter
from liger_models.lora.peft_format import CONFIG_NAME as ADAPTER_CONFIG_NAME
from liger_models.medusa.calibrate import load_medusa_choices
from liger_models.medusa.checkpoint import CONFIG_NAME, holds_base_model, load_heads, read_json, save_heads
from liger_models.medusa.config import MedusaConfig
from liger_models.medusa.decoding import medusa_generate
from liger_models.medusa.heads import MedusaHeads, base_logits
from liger_models.medusa.loss import MedusaOutput, medusa_head_weights, medusa_loss, schedule_factor
from liger_models.medusa.vllm_format import load_vllm
from liger_models.modules.linear import is_plain_linear
from liger_models.modules.moe import load_balancing_loss, recording_router_logits


def _sharded(heads: nn.Module) -> bool:
    """Whether FSDP2 made each head its own unit (train/distributed.py)."""
    if not torch.distributed.is_available():  # a torch build without distributed support has no FSDP
        return False
    from torch.distributed.fsdp import FSDPModule  # here, past the check: such a build has no torch.distributed.fsdp

    return len(heads) > 0 and isinstance(heads[0], FSDPModule)


class MedusaModel(nn.Module):
    """Base model + Medusa heads. `forward(input_ids, labels)` returns a `MedusaOutput` with the combined loss."""

    def __init__(self, base: nn.Module, heads: MedusaHeads, *, stage: int = 1):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"Medusa stage must be 1 (heads only) or 2 (joint), got {stage}")
        cfg = heads.config
        if (cfg.hidden_size, cfg.vocab_size) != (base.config.hidden_size, base.config.vocab_size):
            raise ValueError(f"heads are for hidden/vocab {(cfg.hidden_size, cfg.vocab_size)}, the base model has "
                             f"{(base.config.hidden_size, base.config.vocab_size)}")
        if cfg.share_lm_head and heads._shared[0] is not base.lm_head:
            raise ValueError("shared-lm_head Medusa heads must be built on this base model's lm_head")
        self.base = base
        self.heads = heads
        self.config = cfg
        self.stage = stage
        # The tree `generate` verifies: a calibrated one loaded from medusa_choices.json (medusa/calibrate.py), else
        # None for decoding's default. Not saved by save_pretrained: it was fitted to the weights it was loaded with.
        self.medusa_choices: list[tuple[int, ...]] | None = None
        # Stage 1 trains nothing of the base; stage 2 all of it, or its LoRA adapters alone where it carries some.
        adapters = lora_modules(base)
        base.requires_grad_(stage == 2 and not adapters)
        if adapters:
            for tensor in lora_state_dict(base).values():  # A, B and any modules_to_save weights
                tensor.requires_grad_(stage == 2)

    @classmethod
    def from_base(cls, base: nn.Module, *, stage: int = 1, **config_fields: Any) -> "MedusaModel":
        """Fresh heads for `base` (lm_head copied, or shared with `share_lm_head=True`); fields go to MedusaConfig."""
        config = MedusaConfig.for_base(base, **config_fields)
        return cls(base, MedusaHeads(config, base.lm_head), stage=stage)

    @property
    def base_loss_weight(self) -> float:
        """w0: 0 in stage 1 (whatever the config says: the base is frozen); in stage 2 the config's, else 1."""
        if self.config.base_loss_weight is not None:
            return float(self.config.base_loss_weight) if self.stage == 2 else 0.0
        return 1.0 if self.stage == 2 else 0.0

    def head_scales(self, step: int = 0, max_steps: int = 1) -> list[float]:
        """λ0 · decay^k · sched(step) for k = 1..K."""
        c = self.config
        s = schedule_factor(c.scheduler, step, max_steps)
        return [w * s for w in medusa_head_weights(c.num_heads, c.heads_coefficient, c.decay_coefficient)]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, step: int = 0, max_steps: int = 1,
                normalizer: Any = None) -> MedusaOutput:
        """With labels: the training loss and per-head metrics. Without: base (B, T, V) and heads (K, B, T, V) logits.

        normalizer: see `medusa_loss` (one global count, or per-term counts from `medusa_target_counts`).
        """
        # A mixture-of-experts base trained in stage 2 keeps its load-balancing term where its config asks for it,
        # as its own forward adds it (modules/moe_causal_lm.py): without it the router drifts unbalanced.
        balance = self.stage == 2 and labels is not None and getattr(self.base.config, "output_router_logits", False)
        with recording_router_logits() if balance else contextlib.nullcontext([]) as routed:
            with torch.set_grad_enabled(self.stage == 2 and torch.is_grad_enabled()):
                hidden = self.base.model(input_ids, position_ids=position_ids)  # (B, T, H)
        if self.stage == 1 and torch.is_grad_enabled() and _sharded(self.heads):
            # FSDP2 reduce-scatters a unit's gradients once its inputs' gradients are computed. From a no_grad base
            # that never happens, so every head would stay gathered, its gradients unreduced, until the step's end.
            # A grad-requiring input (one extra H×H GEMM per head in backward) lets each head go as it finishes.
            hidden = hidden.detach().requires_grad_()
        if labels is None:
            return MedusaOutput(logits=base_logits(self.base, hidden), head_logits=self.heads.logits(hidden))
        if not is_plain_linear(self.base.lm_head):
            raise ValueError(f"the base lm_head is a {type(self.base.lm_head).__name__}, not a plain nn.Linear: the "
                             "Medusa loss reads its weight directly (shared by the heads), which would skip what "
                             "the wrapper adds; leave lm_head out of the adapter's target modules (and, on a "
                             "tied model, out of trainable_token_indices: the tied head takes the rows too)")
        out = medusa_loss(hidden, self.heads, labels, position_ids=position_ids,
                          base_lm_head_weight=self.base.lm_head.weight, base_loss_weight=self.base_loss_weight,
                          head_scales=self.head_scales(step, max_steps), normalizer=normalizer,
                          base_logit_softcap=getattr(self.base.config, "logit_softcap", None))
        if routed:  # (empty with every layer dense: nothing to balance)
            cfg = self.base.config
            aux = load_balancing_loss(tuple(routed), cfg.experts_count, cfg.num_experts_per_tok)
            out.loss = out.loss + cfg.router_aux_loss_coef * aux.to(out.loss.device)
            out.aux_loss = aux.detach()
        return out

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int | None = None, **kwargs: Any):
        """Medusa tree decoding with these heads (see `liger_models.medusa.decoding.medusa_generate`, which cuts the
        tree for a batch), with the calibrated tree when one was loaded and no ``medusa_choices`` is given."""
        if kwargs.get("medusa_choices") is None:
            kwargs["medusa_choices"] = self.medusa_choices
        return medusa_generate(self.base, self.heads, input_ids, max_new_tokens, **kwargs)

    def param_groups(self, lr: float, head_lr_multiplier: float = 4.0,
                     weight_decay: float = 0.0) -> list[dict[str, Any]]:
        """Optimizer groups: every head parameter (biases included) at lr × multiplier; base params in stage 2.

        weight_decay is on matrices only: with it, each group's 1-D tensors (the heads' biases, the base's norm
        weights) go to a "<name>_no_decay" sibling at the same lr.
        """
        parts = [("medusa_heads", self.heads, lr * head_lr_multiplier)]
        if self.stage == 2:
            parts.append(("base", self.base, lr))
        groups = []
        for name, module, group_lr in parts:
            params = [p for p in module.parameters() if p.requires_grad]
            flat = [p for p in params if p.dim() < 2] if weight_decay else []
            matrices = [p for p in params if p.dim() >= 2] if flat else params
            if matrices or not flat:
                groups.append({"name": name, "params": matrices, "lr": group_lr, "weight_decay": weight_decay})
            if flat:
                groups.append({"name": f"{name}_no_decay", "params": flat, "lr": group_lr, "weight_decay": 0.0})
        return groups

    def save_pretrained(self, directory: str, *, location: str | None = None) -> None:
        """Stage 1: heads only (config.json + medusa_lm_head.safetensors, Medusa/TGI format B).

        Stage 2: the trained base in HF format (`base.save_pretrained`) plus the heads file, with the `medusa_*`
        fields merged into the base's config.json and `base_model_name_or_path` pointing at this directory (the
        base the heads belong to is the one saved here, not the original) — or at `location`, where a caller that
        writes into a temporary directory will move the files (an atomic checkpoint).

        A base with LoRA adapters: the heads file and config as in stage 1 (`base_model_name_or_path` the original
        base) plus the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), which
        `from_pretrained` attaches again.
        """
        os.makedirs(directory, exist_ok=True)
        if lora_modules(self.base):  # the heads, with the adapter of the base they name, which stays as it was
            save_heads(self.heads, directory)
            save_adapter(self.base, directory, base_model=self.config.base_model_name_or_path)
        elif self.stage == 2:
            self.base.save_pretrained(directory)
            save_heads(self.heads, directory, merge_config=True,
                       base_model_name_or_path=os.path.abspath(location or directory))
        else:
            save_heads(self.heads, directory)

    @classmethod
    def from_pretrained(cls, directory: str, base: nn.Module | None = None, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | int | None = None, *,
                        stage: int | None = None, load_tree: bool = True) -> "MedusaModel":
        """Load heads (format B, v0.1, vLLM layout) or a stage-2 directory (base + heads), and the calibrated tree
        (`medusa_choices.json`, medusa/calibrate.py) when the directory holds one and ``load_tree`` (training, and
        calibrating a new tree, have no use for it).

        base: the base model; when None it is loaded from the directory (stage 2) or from the config's
        `base_model_name_or_path` (a local directory or a Hub id). A directory that holds a LoRA adapter as well
        (stage 2 through adapters) attaches it to that base, unless the base carries adapters already. stage
        defaults to 2 for a directory that holds a full base or an adapter, else 1.
        """
        raw = read_json(os.path.join(directory, CONFIG_NAME))
        vllm = raw.get("model_type") == "medusa"
        full = holds_base_model(raw)
        adapted = os.path.isfile(os.path.join(directory, ADAPTER_CONFIG_NAME))
        if base is None:
            if vllm:
                raise ValueError("a vLLM-layout Medusa checkpoint holds no base model: pass base=")
            base = _load_base(directory if full else raw.get("base_model_name_or_path", ""), dtype, device)
        if adapted:  # heads trained on the base through this adapter (stage 2)
            if not lora_modules(base):
                load_adapter(base, directory)
            else:
                _check_same_adapter(base, directory)
        # The heads live beside the base: same dtype and device unless asked otherwise ("auto" too, as for the
        # causal-LM loaders; `device or` would read device 0 as "not given").
        dtype = parse_dtype(dtype) or base.lm_head.weight.dtype
        device = base.lm_head.weight.device if device is None else torch.device(device)
        if vllm:
            heads = load_vllm(directory, base.lm_head, dtype=dtype, device=device)
        else:
            heads = load_heads(directory, base.lm_head, dtype=dtype, device=device)
        model = cls(base, heads, stage=stage or (2 if full or adapted else 1))
        if load_tree:
            model.medusa_choices = load_medusa_choices(directory, heads.num_heads)
        return model


def _check_same_adapter(base: nn.Module, directory: str) -> None:
    """A base that carries adapters already must carry this directory's (a resumed run restores them first): heads
    decoded or trained on other adapters than their own would be silently wrong."""
    _, saved = read_adapter(directory)
    ours = lora_state_dict(base)
    differs = sorted(set(saved) ^ set(ours)) or [k for k in sorted(ours) if ours[k].shape != saved[k].shape
                                                 or not torch.equal(ours[k].detach().cpu().float(), saved[k].float())]
    if differs:
        raise ValueError(f"the base passed carries other LoRA adapters than the ones {directory} holds for its heads "
                         f"(first difference: {differs[0]}): pass the base without adapters, and the directory's "
                         "are attached")


def _load_base(name_or_path: str, dtype: torch.dtype | None, device: torch.device | str | None) -> nn.Module:
    if not name_or_path:
        raise ValueError("the Medusa config has no base_model_name_or_path: pass base=")
    # As stored: heads trained on a bitsandbytes 4-bit checkpoint decode on its NF4 base.
    path = name_or_path if os.path.isdir(name_or_path) else snapshot(name_or_path)
    return load_causal_lm(path, dtype=dtype, device=device)
