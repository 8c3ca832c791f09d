"""The causal-LM wrapper of the mixture-of-experts families: router logits, HF's auxiliary load-balancing loss.

``output_router_logits`` (the argument, else config's, default false) adds to the output each sparse layer's raw
router logits (N = B·T rows, E) and ``aux_loss`` (modules/moe.py ``load_balancing_loss``, padding rows of a 2D
attention_mask left out); with labels the loss is then HF's ``CE + router_aux_loss_coef · aux_loss``. Without it
the loss is the cross-entropy alone, as in HF.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .cache import KVCache
from .causal_lm import Backbone, LigerForCausalLM
from .moe import load_balancing_loss, recording_router_logits, stacked_checkpoint_names
from .output import model_output


@model_output
@dataclass
class MoeCausalLMOutput:
    """HF's MoeCausalLMOutputWithPast fields that this model has, in HF's order."""

    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: KVCache | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


@model_output
@dataclass
class MoeBackboneOutput:
    """What a mixture-of-experts model's ``base_model(...)`` returns: HF's MoeModelOutputWithPast fields it has."""

    last_hidden_state: torch.Tensor | None = None
    past_key_values: KVCache | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


class MoeBackbone(Backbone):
    """``Backbone`` that also takes ``output_router_logits`` (the argument, else config's) and returns each sparse
    layer's raw router logits, as HF's MoE backbones do: TRL's fused LM head asks for them when the config does,
    and adds HF's load-balancing loss itself."""

    def __call__(self, *args: Any, output_router_logits: bool | None = None, return_dict: bool | None = None,
                 **kwargs: Any) -> MoeBackboneOutput | tuple:
        record = self._lm.config.output_router_logits if output_router_logits is None else output_router_logits
        recording = recording_router_logits() if record else contextlib.nullcontext(None)
        with recording as recorded:
            out = super().__call__(*args, return_dict=True, **kwargs)
        result = MoeBackboneOutput(last_hidden_state=out.last_hidden_state, past_key_values=out.past_key_values,
                                   router_logits=None if recorded is None else tuple(recorded))
        return result if return_dict is None or return_dict else result.to_tuple()


class LigerMoeForCausalLM(LigerForCausalLM):
    """LigerForCausalLM whose config has sparse layers (``layer_is_sparse``) and MoE fields."""

    @property
    def base_model(self) -> MoeBackbone:
        """The decoder called as HF calls a mixture-of-experts backbone (``MoeBackbone``)."""
        return MoeBackbone(self)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, output_router_logits: bool | None = None,
                attention_mask: torch.Tensor | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> MoeCausalLMOutput | tuple:
        """LigerForCausalLM.forward, plus ``output_router_logits`` (module docstring)."""
        record = self.config.output_router_logits if output_router_logits is None else output_router_logits
        if not record:
            out = super().forward(input_ids, labels, position_ids, attention_mask=attention_mask, **kwargs)
            result = MoeCausalLMOutput(loss=out.loss, logits=out.logits, past_key_values=out.past_key_values)
        else:
            with recording_router_logits() as recorded:
                out = super().forward(input_ids, labels, position_ids, attention_mask=attention_mask, **kwargs)
            router_logits = tuple(recorded)
            aux = self._aux_loss(router_logits, attention_mask, out)
            loss = None if out.loss is None else out.loss + self.config.router_aux_loss_coef * aux.to(out.loss.device)
            result = MoeCausalLMOutput(loss=loss, aux_loss=aux, logits=out.logits,
                                       past_key_values=out.past_key_values, router_logits=router_logits)
        return result if return_dict is None or return_dict else result.to_tuple()

    def _aux_loss(self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None,
                  out) -> torch.Tensor:
        if not router_logits:  # every layer dense (mlp_only_layers): nothing to balance
            device = (out.loss if out.loss is not None else out.logits).device
            return torch.zeros((), device=device)
        rows = router_logits[0].shape[0]
        if attention_mask is not None and attention_mask.dim() == 2:
            # With a cache the mask also covers past tokens; the logits are this call's tokens only.
            attention_mask = attention_mask[:, attention_mask.shape[1] - rows // attention_mask.shape[0]:]
        return load_balancing_loss(router_logits, self.config.experts_count, self.config.num_experts_per_tok,
                                   attention_mask)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF init, the stacked expert weights included (normal(0, initializer_range))."""
        super().reset_parameters()
        for layer in self.model.layers:
            if layer.sparse:
                for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    p.normal_(0.0, self.config.initializer_range)

    def expect_stored_layout(self, state: dict[str, nn.Parameter | torch.Tensor], stored: set[str]) -> None:
        """Loader hook (liger_models.hub): where a checkpoint stores a sparse layer's experts stacked, expect the
        stacked tensors by those names instead of the per-expert ones ``state_dict`` gives."""
        for i, layer in enumerate(self.model.layers):
            if layer.sparse:
                prefix = f"model.layers.{i}."
                disk = f"{prefix}{self.config.moe_block_name}."
                stacked_checkpoint_names(state, stored, layer.mlp, tuple(dict.fromkeys((disk, prefix + "mlp."))),
                                         disk, self.config.expert_tensor_names)
