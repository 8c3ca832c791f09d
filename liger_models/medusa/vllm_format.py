"""Medusa heads in vLLM's layout, read by MedusaModel.from_pretrained and written for vLLM (formats B and E).

Medusa/TGI (format B): `{h}.{l}.linear.weight|bias`, `{h}.{L}.weight` (absent when the base lm_head is shared,
`"version": "2"`). vLLM (`vllm/model_executor/models/medusa.py`): a draft-model directory whose `config.json` has
`model_type: "medusa"`, `architectures: ["MedusaModel"]`, `hidden_size`, `vocab_size`, `num_heads`,
`num_hidden_layers` (vLLM's config loader also maps `medusa_num_*` onto these), `truncated_vocab_size`,
`medusa_fc_bias` (vLLM builds the ResBlock Linear with a bias only when true; older vLLM silently skips unknown bias
keys, which changes the model slightly) and `original_lm_head` (one lm_head for all heads, read from
`lm_heads.0.weight`). Tensors: `blocks.{h}.layers.{l}.weight|bias` and `lm_heads.{h}.weight` in `model.safetensors`.
vLLM's draft model cannot see the base model, so a shared-head export carries a copy of the base lm_head.
"""

from __future__ import annotations

import os
import re
import warnings

import torch
from safetensors.torch import load_file

from liger_models.medusa.checkpoint import (CONFIG_NAME, build_heads, config_from_state_dict, read_json,
                                            refuse_model_directory, save_json, save_tensors)
from liger_models.medusa.config import MedusaConfig
from liger_models.medusa.heads import MedusaHeads

VLLM_WEIGHTS_NAME = "model.safetensors"
_VLLM_KEY = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$|^lm_heads\.(\d+)\.weight$")


def medusa_to_vllm_state_dict(sd: dict[str, torch.Tensor], num_layers: int,
                              shared_lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Medusa keys → vLLM keys. `shared_lm_head`: the base lm_head weight, stored as `lm_heads.0.weight`."""
    out = {}
    for key, value in sd.items():
        h, l, rest = key.split(".", 2)
        if rest.startswith("linear."):
            out[f"blocks.{h}.layers.{l}.{rest.removeprefix('linear.')}"] = value
        elif int(l) == num_layers and rest == "weight":
            out[f"lm_heads.{h}.weight"] = value
        else:
            raise ValueError(f"not a Medusa heads key: {key!r}")
    if shared_lm_head is not None:
        if any(k.startswith("lm_heads.") for k in out):
            raise ValueError("heads with their own lm_heads cannot also carry a shared one")
        out["lm_heads.0.weight"] = shared_lm_head
    return out


def vllm_to_medusa_state_dict(sd: dict[str, torch.Tensor], num_layers: int, original_lm_head: bool
                              ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """vLLM keys → (Medusa keys, the shared lm_head weight or None). A `medusa_heads.` prefix is accepted."""
    out: dict[str, torch.Tensor] = {}
    shared = None
    for key, value in sd.items():
        key = key.removeprefix("medusa_heads.")
        m = _VLLM_KEY.match(key)
        if m is None:
            raise ValueError(f"not a vLLM Medusa key: {key!r}")
        if m.group(1) is not None:
            out[f"{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"] = value
        elif original_lm_head:
            if m.group(4) != "0":
                raise ValueError(f"original_lm_head checkpoints hold only lm_heads.0, found {key!r}")
            shared = value
        else:
            out[f"{m.group(4)}.{num_layers}.weight"] = value
    return out, shared


def vllm_config(config: MedusaConfig) -> dict:
    """vLLM's draft config.json for these heads (plus our `medusa_*` loss settings, which vLLM ignores)."""
    ours = {k: v for k, v in config.to_json_dict().items() if k.startswith("medusa_") and "num" not in k}
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": None,
        "medusa_fc_bias": True,
        "original_lm_head": config.share_lm_head,
        "base_model_name_or_path": config.base_model_name_or_path,
        **ours,
    }


def save_vllm(heads: MedusaHeads, directory: str) -> None:
    """Export `heads` as a vLLM Medusa draft model directory (config.json + model.safetensors). The weights are
    complete before config.json replaces a previous export's, and replace theirs right after it, so a failed write of
    either leaves that export as it was."""
    refuse_model_directory(directory)
    config = heads.config
    shared = heads.weight(0) if config.share_lm_head else None
    tensors = medusa_to_vllm_state_dict(heads.state_dict(), config.num_layers, shared)
    save_tensors(os.path.join(directory, VLLM_WEIGHTS_NAME), tensors,
                 lambda: save_json(os.path.join(directory, CONFIG_NAME), vllm_config(config)))


def load_vllm(directory: str, base_lm_head: torch.nn.Linear | None = None, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> MedusaHeads:
    """Load a vLLM Medusa directory back into MedusaHeads.

    With `original_lm_head`, the heads share `base_lm_head`, which must equal the stored `lm_heads.0.weight`
    (when omitted, a bias-free Linear holding the stored weight stands in for it). ResBlock biases absent from the
    file (vLLM's usual bias-free layout, `medusa_fc_bias` false) load as zeros: what a bias-free Linear computes;
    biases stored without `medusa_fc_bias: true` are dropped with a warning, as vLLM never reads them.
    """
    raw = read_json(os.path.join(directory, CONFIG_NAME))
    if raw.get("model_type") != "medusa":
        raise ValueError(f"{directory} is not a vLLM Medusa checkpoint (model_type={raw.get('model_type')!r})")
    num_heads = int(raw.get("num_heads", raw.get("medusa_num_heads", 1)))  # vLLM maps medusa_num_* onto these
    num_layers = int(raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1)))
    original = bool(raw.get("original_lm_head", False))
    tensors = load_file(os.path.join(directory, VLLM_WEIGHTS_NAME))
    truncated = raw.get("truncated_vocab_size")
    if truncated is not None and "vocab_size" in raw and int(truncated) < int(raw["vocab_size"]):
        # vLLM's heads then score only a subset of the vocabulary and map it back through token_map, leaving every
        # other token at -inf; MedusaHeads score the whole vocabulary, which would be a different draft model.
        raise ValueError(f"{directory}: heads over a truncated vocabulary (truncated_vocab_size {truncated} < "
                         f"vocab_size {raw['vocab_size']}, token_map) are not supported; export full-vocabulary heads")
    # vLLM reads token_map only for a truncated vocabulary and ignores it otherwise; so does this loader.
    tensors.pop("token_map", None)
    tensors.pop("medusa_heads.token_map", None)
    sd, shared = vllm_to_medusa_state_dict(tensors, num_layers, original)
    biases = [k for k in sd if k.endswith(".linear.bias")]
    if biases and not raw.get("medusa_fc_bias", False):
        # vLLM builds bias-free Linears without the flag and skips keys that match no parameter: what it serves
        # ignores these biases, so the heads loaded here must too.
        warnings.warn(f"{directory}: ResBlock biases stored but medusa_fc_bias is not true; vLLM ignores them, so they "
                      "are dropped (set medusa_fc_bias to true to use them)", stacklevel=2)
        for key in biases:
            del sd[key]
    for key in [k for k in sd if k.endswith(".linear.weight")]:
        sd.setdefault(key.removesuffix("weight") + "bias", sd[key].new_zeros(sd[key].shape[0]))
    if original:
        if shared is None:
            raise ValueError("original_lm_head is set but lm_heads.0.weight is missing")
        if base_lm_head is None:
            base_lm_head = torch.nn.Linear(shared.shape[1], shared.shape[0], bias=False, device="meta")
            # `device or` would read device 0 (cuda:0) as "not given" and leave this head on the CPU.
            base_lm_head.weight = torch.nn.Parameter(shared.to(device="cpu" if device is None else device,
                                                               dtype=dtype or shared.dtype),
                                                     requires_grad=False)
        else:  # compared at the lower of the two precisions: a bf16 base is the same lm_head as its fp32 export
            low = min(base_lm_head.weight.dtype, shared.dtype, key=lambda d: torch.finfo(d).bits)
            if not torch.equal(base_lm_head.weight.detach().to("cpu", low), shared.to(low)):
                raise ValueError("the checkpoint's lm_heads.0.weight differs from the base model's lm_head")
    config = MedusaConfig.from_json_dict({**raw, "medusa_num_heads": num_heads,
                                          "medusa_num_layers": num_layers, "version": "2" if original else "1"})
    config = config_from_state_dict(config, sd)
    return build_heads(config, sd, base_lm_head, dtype=dtype, device=device)
