"""The causal-LM wrapper every family shares: LM head, fused linear-cross-entropy loss, logits, I/O entry points.

Training: ``model(input_ids, labels=...)`` shifts labels inside (HF convention: labels aligned with inputs, -100
ignored; a packed-document boundary is never a target) and computes the loss with ``fused_linear_cross_entropy``
straight from the final hidden states, so the B·T×V logits never exist. Inference returns logits (all positions or
the last ``num_logits_to_keep``) in the activation dtype, optionally with a KV cache.

HF's training loops and adapters drive the model through the surface of transformers' ``PreTrainedModel``, which is
duck-typed here (transformers is not a runtime dependency): ``Trainer`` and TRL's ``SFTTrainer`` call forward with
their batches and ``num_items_in_batch``, PEFT wraps it (``task_type="CAUSAL_LM"``), and all of them reach for the
embeddings, checkpointing switches, ``config`` and ``generation_config``. A keyword argument of HF's forward that
this one cannot honour is refused with an error that names it, never ignored.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from liger_models import hub
from liger_models.kernels.ops.cross_entropy import cross_entropy
from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

from .cache import KVCache
from .config import GenerationConfig, LigerConfig
from .decoder import DecoderModel, chunk_mlps
from .generate import generate
from .inputs import check_labels
from .linear import is_plain_linear, pack_linears_, runs_forward_hooks
from .lora_embedding import LoraEmbedding
from .lora_experts import LoraExperts
from .lora_linear import LoraLinear, NF4Weight
from .loss import autocast_operands, shift_labels
from .output import model_output


@model_output
@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: KVCache | None = None


@model_output
@dataclass
class BackboneOutput:
    """What ``model.base_model(...)`` returns: the fields of HF's BaseModelOutputWithPast that this model has."""

    last_hidden_state: torch.Tensor | None = None
    past_key_values: KVCache | None = None


# Where the classes of a model that runs without autocast under a no-op autocast come from (native_precision).
_OWN_MODULES = ("liger_models.", "torch.nn.")

# Flash-attention's varlen description of a packed row, which TRL's padding-free collator sends along with the
# position_ids (restarting at 0 per document) that this model reads the packing from.
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def packing_from_positions(position_ids: torch.Tensor) -> dict[str, Any]:
    """The varlen arguments that describe the documents of a packed (1, T) row of position_ids (TRL's rule)."""
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu_seq_lens = torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int32)
    lengths = cu_seq_lens.diff()
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32, device=lengths.device), lengths)
    longest = int(lengths.max()) if len(lengths) else 0
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
            "max_length_k": longest, "seq_idx": seq_idx[None]}


def check_packing(packing: dict[str, Any], position_ids: torch.Tensor | None) -> None:
    """Accept varlen arguments only where they describe the documents that position_ids mark: the model attends
    within those, so arguments saying otherwise would be silently overruled."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"{sorted(packing)} describe a packed batch, which this model reads from position_ids "
                         "restarting at 0 in one (1, seq_len) row; pass those position_ids too")
    expected = packing_from_positions(position_ids)
    for key, value in packing.items():
        want = expected[key]
        same = (value == want) if isinstance(want, int) else (
            isinstance(value, torch.Tensor) and value.shape == want.shape
            and torch.equal(value.to(want.device, torch.int64), want.long()))
        if not same:
            raise ValueError(f"{key} does not describe the documents that position_ids mark (restarting at 0): "
                             f"expected {want!r}, got {value!r}")


# Keyword arguments of HF's forward that are refused rather than ignored: each would change or add to the result.
_REFUSED = {
    "output_attentions": "the attention kernels never form the attention weights",
    "output_hidden_states": "the layers' hidden states are not collected (model.base_model(...) returns the last)",
    "token_type_ids": "these families have no token-type embeddings (HF's forward ignores them; leave them out of "
                      "the batch: tokenizer(..., return_token_type_ids=False))",
    "shift_labels": "pass labels aligned with the inputs (the model shifts them); pre-shifted labels are not supported",
}


def check_hf_kwargs(kwargs: dict[str, Any], position_ids: torch.Tensor | None, caller: str) -> None:
    """forward's extra keyword arguments: output_* flags off, varlen packing arguments that match position_ids;
    anything else is refused by name. None means not given, as in HF's signatures."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    for key in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(key, False):
            raise ValueError(f"{caller}: {key}=True is not supported: {_REFUSED[key]}")
    packing = {k: kwargs.pop(k) for k in _PACKING_KEYS if k in kwargs}
    if packing:
        check_packing(packing, position_ids)
    for key in kwargs:
        reason = _REFUSED.get(key, "not an argument of this model")
        raise TypeError(f"{caller} got an unsupported keyword argument {key!r}: {reason}")


def _output_requires_grad(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
    output.requires_grad_(True)


def offloaded_checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint, with the tensors it saves for the recompute held in host memory."""
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return checkpoint(function, *args, **kwargs)


def padded_vocab_size(new_num_tokens: int | None, pad_to_multiple_of: int | None, current: int) -> int | None:
    """HF's rule: new_num_tokens (else the current size) rounded up to a multiple of pad_to_multiple_of."""
    if pad_to_multiple_of is None:
        return new_num_tokens
    if not isinstance(pad_to_multiple_of, int) or isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
    size = current if new_num_tokens is None else new_num_tokens
    return -(-size // pad_to_multiple_of) * pad_to_multiple_of


@torch.no_grad()
def init_added_rows(old: torch.Tensor, new: torch.Tensor, added: int, mean_resizing: bool, std: float) -> None:
    """New vocabulary rows, drawn as transformers' resize_token_embeddings draws them (the same RNG use, so a seeded
    run gives HF's values): mean_resizing samples N(mean, 1e-9·covariance) of the old rows (the mean alone when that
    covariance is not positive definite), so the new tokens barely move the next-token distribution; else the whole
    new matrix is drawn from N(0, initializer_range) before the old rows are copied back over it."""
    if not mean_resizing:
        new.normal_(0.0, std)
        return
    rows = old.float()
    mean = rows.mean(0)
    centered = rows - mean
    covariance = 1e-9 * (centered.T @ centered / rows.shape[0])
    if torch.distributions.constraints.positive_definite.check(covariance).all():
        sample = torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance).sample((added,))
        new[-added:] = sample.to(new.dtype)
    else:
        new[-added:] = mean[None].repeat(added, 1).to(new.dtype)


@torch.no_grad()
def resize_embedding_(embedding: nn.Embedding, size: int, mean_resizing: bool, std: float) -> None:
    """Resize in place, keeping the module and its Parameter object (HF does; a tied head shares it)."""
    if not isinstance(embedding, nn.Embedding):
        raise TypeError(f"resize_token_embeddings needs an nn.Embedding, got {type(embedding).__name__}")
    old = embedding.weight
    fresh = nn.Embedding(size, old.shape[1], device=old.device, dtype=old.dtype).weight  # HF builds one too
    if size > old.shape[0]:
        init_added_rows(old, fresh, size - old.shape[0], mean_resizing, std)
    kept = min(size, old.shape[0])
    fresh[:kept] = old[:kept]
    old.data = fresh.data
    embedding.num_embeddings = size
    if embedding.padding_idx is not None and embedding.padding_idx >= size:
        embedding.padding_idx = None


@torch.no_grad()
def resized_head(head: nn.Module, size: int, mean_resizing: bool, std: float) -> nn.Linear:
    """A new (vocabulary, hidden) nn.Linear holding head's rows, built as HF's _get_resized_lm_head builds it."""
    if type(head) is not nn.Linear or head.bias is not None:
        raise TypeError(f"resize_token_embeddings resizes an untied lm_head only when it is a plain bias-free "
                        f"nn.Linear, got {head!r} (merge or remove an adapter on lm_head first)")
    old = head.weight
    new = nn.Linear(old.shape[1], size, bias=False, device=old.device, dtype=old.dtype)
    if size > old.shape[0]:
        init_added_rows(old, new.weight, size - old.shape[0], mean_resizing, std)
    kept = min(size, old.shape[0])
    new.weight[:kept] = old[:kept]
    new.requires_grad_(old.requires_grad)
    return new


def keep_positions(hidden: torch.Tensor, num_logits_to_keep: int, logits_to_keep: int | torch.Tensor | None):
    """The positions whose logits are wanted: all (0), the last k (int), or the given indices (tensor)."""
    if logits_to_keep is None:
        logits_to_keep = num_logits_to_keep
    elif num_logits_to_keep:
        raise ValueError("pass num_logits_to_keep or logits_to_keep (HF v5's name for it), not both")
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep]
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


def _tied_head_as_its_own_tensor(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A tied lm_head leaves ``state_dict()`` (keep_vars=False) as its own copy of the embedding, like the packed
    weights (modules/linear.py): savers that refuse shared tensors take the dict as it is (HF Trainer saves a model
    that is not a PreTrainedModel with safetensors' save_file), and loading it writes the same values into the one
    tied tensor. ``save_pretrained`` writes the head once, as HF does."""
    head, embedding = state_dict.get(prefix + "lm_head.weight"), state_dict.get(prefix + "model.embed_tokens.weight")
    if (head is None or embedding is None or isinstance(head, nn.Parameter) or type(head) is not torch.Tensor
            or head.is_meta or head.data_ptr() != embedding.data_ptr()):
        return
    state_dict[prefix + "lm_head.weight"] = head.clone()


class LigerForCausalLM(nn.Module):
    """Decoder (``.model``) + LM head (``.lm_head``, tied to the embedding when the config says so)."""

    config_class: ClassVar[type[LigerConfig]] = LigerConfig
    # What transformers' Trainer, PEFT and TRL read off a PreTrainedModel class.
    base_model_prefix: ClassVar[str] = "model"
    main_input_name: ClassVar[str] = "input_ids"
    supports_gradient_checkpointing: ClassVar[bool] = True
    # forward takes num_items_in_batch: Trainer passes it and leaves the loss unscaled for gradient accumulation.
    accepts_loss_kwargs: ClassVar[bool] = True
    # HF's causal-LM loss name: Trainer then counts num_items_in_batch over labels[:, 1:], the targets this loss
    # has after its shift (counting labels[:, 0] too would divide by one token per row too many).
    loss_type: ClassVar[str] = "ForCausalLM"
    # config.json's dropout rates that transformers applies in training and these models do not (the fused attention
    # and add-norm kernels have no dropout). Released checkpoints of these families set them to 0.
    UNAPPLIED_DROPOUT: ClassVar[tuple[str, ...]] = ("attention_dropout", "resid_pdrop", "embd_pdrop")

    # HF's declaration (transformers v5's form) that lm_head's weight is the embedding's when the config ties them
    # (the config decides: tie_word_embeddings false means untied). PEFT reads it to give a tied lm_head the same
    # trainable-token rows as the embedding (trainable_token_indices, modules_to_save with ensure_weight_tying):
    # without it the head kept the old rows while HF + PEFT's moved, silently.
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    @property
    def _no_split_modules(self) -> list[str]:
        """The decoder layers' class names, HF's attribute: Accelerate's FSDP ("transformer_based_wrap", what HF
        Trainer's ``fsdp="full_shard auto_wrap"`` uses) makes each such layer a unit of its own. Without it that policy
        wrapped nothing below the root, silently: every parameter gathered at once."""
        return sorted({type(layer).__name__ for layer in self.model.layers})

    def __init__(self, config: LigerConfig) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        # The checkpoint's generation_config.json ({} if none; from_pretrained fills it, save_pretrained writes it
        # back): generate takes its eos / pad ids from here before config.json's, as HF does.
        self.generation_config = {}
        # Set by from_pretrained on a multimodal checkpoint (Gemma 3 4B-27B): the rest of that checkpoint, which
        # save_pretrained writes back around the decoder (liger_models/wrapped_checkpoint.py).
        self.checkpoint_wrapper = None
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A labelled forward computes its loss without forming logits. With this set it also returns them, detached
        # (what HF Trainer's compute_metrics / preprocess_logits_for_metrics receive); costs B·T·V activations.
        self.logits_with_loss = False
        self.tie_weights()
        self.reset_parameters()
        self.register_state_dict_post_hook(_tied_head_as_its_own_tensor)

    def train(self, mode: bool = True) -> "LigerForCausalLM":
        if mode:
            rates = {k: v for k in self.UNAPPLIED_DROPOUT if (v := self.config.get(k)) not in (None, 0, 0.0)}
            if rates:
                warnings.warn(f"config.json sets {', '.join(f'{k}={v}' for k, v in rates.items())}, which "
                              "transformers applies in training: this model trains without that dropout (set it to "
                              "0 in the config to say so)", stacklevel=2)
        return super().train(mode)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF init: normal(0, initializer_range) weights, zero biases and padding row; norms keep their own init."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if getattr(module, "padding_idx", None) is not None:
                    module.weight[module.padding_idx].zero_()
        self.pack_()

    def pack_(self) -> "LigerForCausalLM":
        """Lay q|k|v and gate|up weights back to back so each runs as one GEMM (see modules/linear.py)."""
        for module in self.modules():
            for group in getattr(module, "packed_groups", lambda: [])():
                pack_linears_(group)
        return self

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half() move each parameter on its own; lay the fused groups out again afterwards.
        super()._apply(fn, recurse)
        return self.pack_()

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, normalizer: float | torch.Tensor | None = None,
                num_logits_to_keep: int = 0, past_key_values: KVCache | None = None,
                use_cache: bool | None = False, attention_mask: torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> CausalLMOutput | tuple:
        """Loss (with labels; logits None unless ``logits_with_loss``) or logits (B, T or num_logits_to_keep, V); see
        the module docstring.

        attention_mask: HF's (B, past + T) 0/1 mask; padded keys are hidden. As in HF, position_ids still default
        to past..past+T−1 (pass cumsum-based ones for left padding, as ``generate`` does), and labels at padding
        should be -100. logits_to_keep is HF v5's name for num_logits_to_keep; it also takes a tensor of positions.

        HF's arguments: inputs_embeds (B, T, H) instead of input_ids (see DecoderModel.forward); num_items_in_batch
        is Trainer's name for normalizer (the loss is summed over the targets and divided by it); return_dict=False
        gives ``to_tuple()``; use_cache None means False; output_attentions / output_hidden_states only when false,
        and the varlen packing arguments of TRL's padding-free batches only when they match position_ids
        (``check_hf_kwargs``). Anything else is refused by name.
        """
        normalizer = self._normalizer(normalizer, num_items_in_batch)
        with self.native_precision():
            hidden, past_key_values = self._hidden_states(input_ids, position_ids, attention_mask, inputs_embeds,
                                                          past_key_values, use_cache, kwargs, "forward")
            out = self._loss_or_logits(hidden, labels, position_ids, normalizer, num_logits_to_keep, logits_to_keep,
                                       past_key_values)
        return out if return_dict is None or return_dict else out.to_tuple()

    def native_precision(self) -> contextlib.AbstractContextManager:
        """Autocast switched off for a call where it would only change the path, not the precision: its dtype is
        the model's (a bf16 model under HF Trainer's or TRL's ``bf16=True``, TRL's default) and every module is this
        library's or torch.nn's. Such a model computes in bf16 by itself (norms and losses in fp32, adapters in
        their own dtype, as without autocast), but autocast turns each fused path (packed GEMMs, norm → linear,
        gated → down, the LoRA core) to its unfused fallback, which only an fp32 model under autocast needs.
        A module of another library (PEFT's wrappers, bitsandbytes' linears) keeps autocast on: what it computes
        under autocast is its own business."""
        weight = self.get_input_embeddings().weight
        device = weight.device.type
        if (not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != weight.dtype
                or not all(type(m).__module__.startswith(_OWN_MODULES) for m in self.modules())):
            return contextlib.nullcontext()
        return torch.autocast(device, enabled=False)

    @staticmethod
    def _normalizer(normalizer, num_items_in_batch):
        if num_items_in_batch is None:
            return normalizer
        if normalizer is not None:
            raise ValueError("pass normalizer or num_items_in_batch (Trainer's name for it), not both")
        return num_items_in_batch

    def _hidden_states(self, input_ids, position_ids, attention_mask, inputs_embeds, past_key_values, use_cache,
                       kwargs: dict, caller: str) -> tuple[torch.Tensor, KVCache | None]:
        """The decoder's final hidden states (B, T, H) and the cache, after checking HF's extra arguments."""
        check_hf_kwargs(kwargs, position_ids, f"{type(self).__name__}.{caller}")
        if past_key_values is not None and not callable(getattr(past_key_values, "seq_length", None)):
            raise TypeError(f"past_key_values must be this model's KVCache, got {type(past_key_values).__name__} "
                            "(transformers' Cache classes, which PEFT's prefix tuning builds, are not supported)")
        if use_cache and past_key_values is None:
            past_key_values = KVCache()
        hidden = self.model(input_ids, position_ids, cache=past_key_values, attention_mask=attention_mask,
                            inputs_embeds=inputs_embeds)
        return hidden, past_key_values

    def _loss_or_logits(self, hidden, labels, position_ids, normalizer, num_logits_to_keep, logits_to_keep,
                        past_key_values) -> CausalLMOutput:
        if labels is not None:
            check_labels(labels, hidden.shape[:2], hidden.device)
            targets = shift_labels(labels, 1, position_ids)  # (B, T)
            softcap = self.config.logit_softcap  # applied inside the loss kernels, to fp32 logits
            operands = self._fused_head_operands(hidden)
            if operands is None:
                # A head the fused loss cannot read (PEFT's wrapped lm_head, DoRA or an NF4 base on ours, forward
                # hooks): its logits are formed.
                logits = self.lm_head(hidden)
                # a copy: the loss may write its gradient over the logits
                kept = self._capped(logits.detach().clone()) if self.logits_with_loss else None
                loss = cross_entropy(logits, targets, normalizer=normalizer, softcap=softcap)
                return CausalLMOutput(loss=loss, logits=kept, past_key_values=past_key_values)
            hidden, weight, bias, low_rank = operands
            logits = None
            if self.logits_with_loss:
                with torch.no_grad():  # the logits this loss is computed from (an adapter's dropout mask included)
                    logits = F.linear(hidden, weight, bias)
                    if low_rank is not None:
                        u, lw = low_rank
                        logits.view(-1, logits.shape[-1]).addmm_(u.reshape(-1, u.shape[-1]), lw.t())
                    logits = self._capped(logits)
            loss = fused_linear_cross_entropy(hidden, weight, targets, bias, normalizer=normalizer, softcap=softcap,
                                              low_rank=low_rank)
            return CausalLMOutput(loss=loss, logits=logits, past_key_values=past_key_values)
        hidden = keep_positions(hidden, num_logits_to_keep, logits_to_keep)
        return CausalLMOutput(logits=self.compute_logits(hidden), past_key_values=past_key_values)

    def _fused_head_operands(self, hidden: torch.Tensor):
        """(hidden, weight, bias, low_rank) of ``fused_linear_cross_entropy`` that compute lm_head(hidden), in
        autocast's dtype under autocast (as lm_head's GEMM would run), or None when lm_head is not one the loss can
        read: a plain nn.Linear, or our LoraLinear on a dense base with no adapter, a merged one or a plain LoRA
        adapter, whose u·Bᵀ becomes the loss's low-rank term (LoraLinear.low_rank_terms; its dropout draws its mask
        here). The cases where LoraLinear's own forward takes ``composed`` (autocast, torch.compile, a trainable
        base) are readable too: u comes from plain autograd ops, the loss has a custom op for compile and computes
        dW when W requires grad, and under autocast every operand is in autocast's dtype as the head's GEMMs would
        have it. Trainable-token rows on the head are a low-rank term as well (modules/token_rows.py). Not readable,
        so formed: PEFT's own wrapper of lm_head, a DoRA adapter (its per-row factor m / n scales the base's logits
        too, no low-rank term), an NF4 base (never on lm_head here, but its weight is codes), and a head with forward
        hooks, which a call would run."""
        head = self.lm_head
        if is_plain_linear(head):
            return (*autocast_operands(hidden, head.weight), None, None)
        if not isinstance(head, LoraLinear) or runs_forward_hooks(head) or head.quant is not None:
            return None
        if head.has_adapter and (head.use_dora or head.replaces_columns):
            return None
        hidden, weight = autocast_operands(hidden, head.weight)
        bias = None if head.bias is None else head.bias.to(weight.dtype)
        if head.replaces_columns:  # trainable-token rows: a low-rank term too (modules/token_rows.py)
            return hidden, weight, bias, head.token_rows.low_rank_terms(hidden, weight)
        return hidden, weight, bias, head.low_rank_terms(hidden) if head.has_adapter else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(hidden), soft-capped as HF does when the config says so (Gemma 2: c·tanh(z / c) in the logits'
        dtype, three rounded ops as there). Every path that returns or samples logits goes through here."""
        return self._capped(self.lm_head(hidden))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        softcap = self.config.logit_softcap
        return logits if softcap is None else torch.tanh(logits / softcap) * softcap

    generate = generate

    # ---- the PreTrainedModel surface that HF's Trainer, TRL and PEFT use (module docstring) -------------------
    @property
    def generation_config(self) -> GenerationConfig:
        """The checkpoint's generation_config.json (a dict, {} without the file) with HF's attribute access."""
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value: dict | None) -> None:
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"generation_config must be a dict of generation_config.json's settings, got "
                            f"{type(value).__name__}")
        self._generation_config = GenerationConfig(value or {}, model_config=self.config)

    @property
    def base_model(self) -> "Backbone":
        """The decoder, called as HF calls a model's backbone (TRL's fused LM head does): see ``Backbone``."""
        return Backbone(self)

    @property
    def device(self) -> torch.device:
        """The first parameter's device (HF's rule: the model is assumed to sit on one)."""
        return next(p.device for p in self.parameters())

    @property
    def dtype(self) -> torch.dtype:
        """The first floating-point parameter's dtype (HF's rule)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Record tags (TRL's trainers add theirs) in ``model_tags``, which Trainer puts on its model card."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        self.model_tags = list(dict.fromkeys([*(getattr(self, "model_tags", None) or []), *tags]))

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        # A head handed over by the backbone call just made (``base_model``), once; otherwise lm_head itself.
        projected = self.__dict__.pop("_projected_head", None)
        return projected if projected is not None else self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters counted as HF counts them: a tied head once; exclude_embeddings drops the embedding tables
        (a LoRA-adapted one included; its adapter counts); an NF4 weight counts its weights (two per code byte, as
        HF counts bitsandbytes' 4-bit ones), not the bytes of its codes and scales."""
        embeddings = {f"{name}.weight" for name, m in self.named_modules()
                      if isinstance(m, (nn.Embedding, LoraEmbedding))}
        counted = {}  # parameter name → the weights it stands for, where that is not its numel
        for name, m in self.named_modules():
            if isinstance(m, NF4Weight):
                counted[f"{name}.codes"], counted[f"{name}.absmax_bytes"] = 2 * m.codes.numel(), 0
        return sum(counted.get(name, p.numel()) for name, p in self.named_parameters()
                   if (p.requires_grad or not only_trainable) and not (exclude_embeddings and name in embeddings))

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """HF's resize: rows kept or cut at the end, new rows drawn as transformers 5 draws them
        (``init_added_rows``), an untied head resized alike, the tie and config.vocab_size kept right."""
        embedding = self.get_input_embeddings()
        size = padded_vocab_size(new_num_tokens, pad_to_multiple_of, embedding.weight.shape[0])
        if size is None:
            return embedding
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"new_num_tokens must be a positive integer, got {new_num_tokens!r}")
        std = self.config.initializer_range or 0.02
        resize_embedding_(embedding, size, mean_resizing, std)
        head = self.get_output_embeddings()
        if head.weight is embedding.weight:  # tied: the one Parameter is resized already
            head.out_features = size
        elif head.weight.shape[0] != size:
            self.set_output_embeddings(resized_head(head, size, mean_resizing, std))
        self.config.vocab_size = size
        self.tie_weights()
        return embedding

    def enable_input_require_grads(self) -> None:
        """Make the input embeddings' output require grad, so gradients flow through checkpointed layers and reach
        adapters while the embeddings are frozen (PEFT, reentrant checkpointing), as HF's does."""
        self.disable_input_require_grads()
        self._require_grads_hooks = [self.get_input_embeddings().register_forward_hook(_output_requires_grad)]

    def disable_input_require_grads(self) -> None:
        for hook in getattr(self, "_require_grads_hooks", []):
            hook.remove()
        self._require_grads_hooks = []

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute decoder layers in backward instead of keeping their activations while training, as HF's:
        every ``every_n_layers``-th layer, through torch.utils.checkpoint with ``activation_checkpointing_kwargs``
        (default ``use_reentrant=False``), with what it saves in host memory if ``offload``. Like HF's, it also
        makes the embeddings' output require grad (``enable_input_require_grads``), which reentrant checkpointing
        needs when the embeddings are frozen."""
        if not isinstance(every_n_layers, int) or isinstance(every_n_layers, bool) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive integer, got {every_n_layers!r}")
        kwargs = activation_checkpointing_kwargs
        if kwargs is None:
            kwargs = {"use_reentrant": False}
        self.model.checkpoint_fn = partial(offloaded_checkpoint if offload else checkpoint, **kwargs)
        self.model.checkpoint_every = every_n_layers
        self.model.gradient_checkpointing = True
        self.enable_input_require_grads()

    def mlp_chunking_enable(self, tokens: int = 8192) -> None:
        """Run each dense decoder layer's MLP (its input norm, gate|up, activation and down) over chunks of at most
        ``tokens`` rows in differentiable calls, each recomputed in backward: the layer then holds the MLP's
        intermediates for one chunk at a time instead of every token's. For long sequences with activation
        checkpointing, where those intermediates are most of the per-token memory left; it costs one more MLP
        forward a step. A mixture-of-experts layer is refused (its routing is not chunked)."""
        chunk_mlps(self.model.layers, tokens)

    def mlp_chunking_disable(self) -> None:
        chunk_mlps(self.model.layers, None)

    def activation_checkpointing_disable(self) -> None:
        """Keep every layer's activations again (the embeddings' require-grad hook stays, as HF leaves it)."""
        self.model.gradient_checkpointing = False

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """HF's older name of ``activation_checkpointing_enable``."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, past_key_values: KVCache | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      inputs_embeds: torch.Tensor | None = None,
                                      position_ids: torch.Tensor | None = None, use_cache: bool = True,
                                      **kwargs: Any) -> dict[str, Any]:
        """forward's arguments for the next decoding step, as HF's: input_ids (B, past + new) cut to the tokens the
        cache has not seen (inputs_embeds instead while the cache is empty), position_ids from the attention mask's
        cumulative sum (left padding), the cache and the mask; other keyword arguments pass through (forward
        refuses the ones it does not take)."""
        past = past_key_values.seq_length() if past_key_values is not None else 0
        inputs = {"inputs_embeds": inputs_embeds} if inputs_embeds is not None and past == 0 \
            else {"input_ids": input_ids[:, past:]}
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        if position_ids is not None:
            position_ids = position_ids[:, -next(iter(inputs.values())).shape[1]:]
        inputs.update(position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                      attention_mask=attention_mask)
        return {**{k: v for k, v in kwargs.items() if v is not None}, **inputs}

    # ---- checkpoints (implemented in liger_models.hub) ------------------------------------------------------
    @classmethod
    def from_config(cls, config: LigerConfig, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> "LigerForCausalLM":
        """A randomly initialised model (HF init) in ``dtype`` on ``device``."""
        with torch.device("cpu" if device is None else device):  # not `device or`: device 0 is cuda:0
            model = cls(config)
        return model.to(dtype) if dtype is not None else model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | int | None = None) -> "LigerForCausalLM":
        """Load an HF-format directory (config.json + safetensors); dtype (None or "auto") defaults to the config's,
        else the checkpoint's."""
        return hub.load_pretrained(path, cls, dtype=dtype, device=device)

    @classmethod
    def from_hub(cls, repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None,
                 local_files_only: bool = False, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | int | None = None,
                 token: str | bool | None = None) -> "LigerForCausalLM":
        """Download (or find in the HF cache) *.json, *.safetensors and tokenizer files, then ``from_pretrained``;
        ``token`` (else HF_TOKEN / the stored login) for gated repos."""
        path = hub.snapshot(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                        token=token)
        return cls.from_pretrained(path, dtype=dtype, device=device)

    def save_pretrained(self, directory: str | Path, max_shard_size: int | str = "5GB", *,
                        safe_serialization: bool = True) -> None:
        """Write HF-format safetensors (+ index when sharded) and config.json, atomically. safe_serialization is
        accepted as transformers' callers pass it; only safetensors are written."""
        if not safe_serialization:
            raise ValueError("save_pretrained writes safetensors only (safe_serialization=False asks for "
                             "pytorch_model.bin, which this library does not write)")
        self._refuse_what_a_dense_checkpoint_cannot_hold()
        hub.save_pretrained(self, directory, max_shard_size=max_shard_size)

    def _refuse_what_a_dense_checkpoint_cannot_hold(self) -> None:
        """NF4 weights are not in the state dict (a checkpoint would lack those linears, and transformers would
        initialise them at random), and LoRA adapters would sit under names transformers ignores: each is refused,
        naming the writer that keeps it."""
        quantised = [n.removesuffix(".quant").replace(".nf4.", ".") for n, m in self.named_modules()
                     if isinstance(m, NF4Weight)]
        if quantised:
            raise ValueError(f"save_pretrained: {len(quantised)} weights ({quantised[0]}, ...) are NF4, "
                             "which a checkpoint of dense weights would leave out; write a bitsandbytes 4-bit "
                             "checkpoint with liger_models.lora.save_bnb_4bit(model, dir), or a dense one with the "
                             "adapters merged with liger_models.lora.save_merged(model, dir)")
        adapted = [n for n, m in self.named_modules()
                   if isinstance(m, (LoraLinear, LoraEmbedding, LoraExperts)) and m.carries_adapter]
        if adapted:
            raise ValueError(f"save_pretrained: the model carries LoRA adapters ({adapted[0]}, ...), which an HF "
                             "checkpoint would hold under names transformers ignores; save the adapter with "
                             "liger_models.lora.save_adapter(model, dir), or a checkpoint with the adapters merged "
                             "with liger_models.lora.save_merged(model, dir)")


class Backbone:
    """``model.base_model``: the decoder called as HF calls a causal LM's backbone, keyword arguments in and
    ``BackboneOutput(last_hidden_state=...)`` out (TRL's fused LM head projects those hidden states through
    ``get_output_embeddings()`` itself). Other attributes are the decoder module's (``model.model``).

    Such a caller reads the head's ``weight`` and ``bias`` and multiplies by them: on a head that carries an unmerged
    adapter or trainable-token rows that product would leave them out (and they would never train), silently. So
    a call here hands the next ``get_output_embeddings()`` a ``ProjectedHead`` whose weight is the adapted one
    (``LoraLinear.projection_weight``), formed in this call's graph."""

    def __init__(self, lm: LigerForCausalLM) -> None:
        self._lm = lm

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                 inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                 return_dict: bool | None = None, **kwargs: Any) -> BackboneOutput | tuple:
        with self._lm.native_precision():
            hidden, past_key_values = self._lm._hidden_states(input_ids, position_ids, attention_mask, inputs_embeds,
                                                              past_key_values, use_cache, kwargs, "base_model")
            head = self._lm.lm_head
            adapted = isinstance(head, LoraLinear) and (head.has_adapter or head.replaces_columns)
            projected = ProjectedHead(head.projection_weight(), head.bias) if adapted else None
        self._lm.__dict__["_projected_head"] = projected
        out = BackboneOutput(last_hidden_state=hidden, past_key_values=past_key_values)
        return out if return_dict is None or return_dict else out.to_tuple()

    forward = __call__

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lm.model, name)


@dataclass
class ProjectedHead:
    """What ``get_output_embeddings()`` returns right after a ``base_model`` call on an adapted head (``Backbone``):
    the head's adapted weight and its bias, for a caller that computes weight·h + bias itself."""

    weight: torch.Tensor
    bias: torch.Tensor | None
