"""Medusa heads on disk in the format FasterDecoding/Medusa and TGI read (docs/medusa.md#checkpoint-formats, format B).

A heads directory holds `config.json` (`MedusaConfig.to_json_dict`) and `medusa_lm_head.safetensors` with unprefixed
keys `{h}.{l}.linear.weight|bias` and, unless the lm_head is shared, `{h}.{L}.weight`. A stage-2 directory is the
base model's HF checkpoint (its own `config.json` with the `medusa_*` fields merged in, as in the Medusa-2 format C
config) plus the same heads file. Reading also accepts upstream's variants: the v0.1 `medusa_lm_head.pt`, a
`medusa_head.` key prefix (Liger's example), a config whose head count disagrees with the file (the released
Vicuna v1.3 heads say 2 and hold 5: the file wins) or that omits `medusa_num_layers` / `version` (the file
decides), and upstream's aliased `[ResBlock(H)] * n` layers (each loaded as its own copy). Every file is written
to a temporary name and renamed into place, so a failed save leaves the previous file intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import warnings
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from liger_models import atomic
from liger_models.input_files import read_json_object
from liger_models.medusa.config import MedusaConfig
from liger_models.medusa.heads import MedusaHeads

CONFIG_NAME = "config.json"
HEADS_NAME = "medusa_lm_head.safetensors"
LEGACY_HEADS_NAME = "medusa_lm_head.pt"
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def save_json(path: str, obj: dict[str, Any]) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    atomic.write_file(path, write)


def save_tensors(path: str, tensors: dict[str, torch.Tensor], before_rename: Callable[[], None] | None = None) -> None:
    """Atomically write a safetensors file (CPU copies, contiguous: safetensors rejects views sharing storage).

    before_rename: called once the file is complete under its temporary name, just before it replaces `path` (a
    directory's config.json written there is never left describing the previous file: a failed write of either leaves
    both old files in place)."""
    data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}

    def write(tmp: str) -> None:
        save_file(data, tmp, metadata={"format": "pt"})
        if before_rename is not None:
            before_rename()

    atomic.write_file(path, write)


def holds_base_model(config: dict[str, Any]) -> bool:
    """Whether a heads directory's config.json is a whole base model's (a stage-2 directory): it names a model_type,
    and not vLLM's "medusa" (an empty one names no base)."""
    return config.get("model_type") not in (None, "", "medusa")


def read_json(path: str) -> dict[str, Any]:
    """A heads config (a JSON object); a broken one is named with the line where parsing stopped."""
    return read_json_object(path)


def save_heads(heads: MedusaHeads, directory: str, *, merge_config: bool = False,
               base_model_name_or_path: str | None = None) -> None:
    """Write `heads` as format B into `directory`.

    merge_config: add the `medusa_*` fields to the `config.json` already there (a stage-2 base checkpoint)
    instead of writing the heads-only config. base_model_name_or_path overrides the config's value.
    """
    config = heads.config
    path = os.path.join(directory, CONFIG_NAME)
    if not merge_config:
        refuse_model_directory(directory)
    fields = config.to_json_dict()
    if base_model_name_or_path is not None:
        fields["base_model_name_or_path"] = base_model_name_or_path
    if merge_config:
        # A base loaded from a stage-2 directory writes that config's medusa_* / version fields back (extra config
        # keys): drop them, or one these heads' config omits would stay (a stale "version": "2" declares copied heads
        # shared, and the directory no longer loads).
        merged = {k: v for k, v in read_json(path).items() if k != "version" and not k.startswith("medusa_")}
        # The base's own hidden_size / vocab_size are already there and are the same numbers.
        fields = {**merged, **{k: v for k, v in fields.items() if k not in ("hidden_size", "vocab_size")}}
    # The config goes in once the weights are complete, and the weights right after it: a failure in either write
    # leaves the previous heads with their own config (new weights under an old config may hold another head count).
    save_tensors(os.path.join(directory, HEADS_NAME), heads.state_dict(), lambda: save_json(path, fields))


def refuse_model_directory(directory: str) -> None:
    """Raise a ValueError when `directory` holds a model (a base, a stage-2 checkpoint): a config.json with a
    model_type other than vLLM's "medusa". A heads-only config.json written there would replace the model's, and
    neither that model nor the heads would load."""
    path = os.path.join(directory, CONFIG_NAME)
    if os.path.exists(path) and read_json(path).get("model_type", "medusa") != "medusa":
        raise ValueError(f"{directory} holds a model (its config.json has a model_type): save the heads into a "
                         "directory of their own, or base and heads together as stage 2")


def load_heads_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """The heads' tensors with Medusa keys (`.safetensors`, else the v0.1 `.pt`; `medusa_head.` prefix stripped)."""
    path, legacy = os.path.join(directory, HEADS_NAME), os.path.join(directory, LEGACY_HEADS_NAME)
    if not os.path.exists(path) and not os.path.exists(legacy):
        raise FileNotFoundError(f"no {HEADS_NAME} (or {LEGACY_HEADS_NAME}) in {directory}")
    try:
        if os.path.exists(path):
            sd = load_file(path)
        else:
            path = legacy
            sd = torch.load(legacy, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        # The readers' own messages name no file ("invalid header length", "PytorchStreamReader failed ...").
        raise ValueError(f"{path} is not a readable heads file ({os.path.getsize(path)} bytes; truncated or "
                         f"damaged?): {exc}") from exc
    sd = {k.removeprefix("medusa_head."): v for k, v in sd.items()}
    bad = [k for k in sd if not _KEY.match(k)]
    if bad:
        raise ValueError(f"unexpected keys in Medusa heads file: {bad[:5]}")
    return unshare(sd)


def unshare(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` with every tensor in its own storage (a copy for each one after the first that aliases another).

    torch.save keeps aliasing, and upstream's `[ResBlock(H)] * n` (one module n times) saves one block under n layer
    keys. Loaded as is (assign=True, same device and dtype), our layers would share storage: tied for good, each
    optimizer step applied once per alias, and a safetensors save refused.
    """
    seen: set[tuple[torch.device, int]] = set()
    out = {}
    for key, tensor in sd.items():
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        out[key] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def file_layout(sd: dict[str, torch.Tensor]) -> tuple[int, int, bool]:
    """(heads, ResBlocks per head, shared lm_head) as the tensors of a heads file lay them out."""
    check_tensors(sd)
    heads = 1 + max(int(_KEY.match(k).group(1)) for k in sd)
    layers = len({int(m.group(2)) for k in sd if (m := _KEY.match(k)) and m.group(3).startswith("linear")})
    shared = not any(_KEY.match(k).group(3) == "weight" for k in sd)
    return heads, layers, shared


def check_tensors(sd: dict[str, torch.Tensor]) -> None:
    """Raise a ValueError for a heads file that cannot hold heads: no tensors, empty ones (heads saved from sharded
    parameters without gathering them, Liger-Kernel issue #309), or a weight / bias of the wrong rank."""
    if not sd:
        raise ValueError("the Medusa heads file holds no tensors")
    empty = [k for k, v in sd.items() if v.numel() == 0]
    if empty:
        raise ValueError(f"the Medusa heads file holds empty tensors ({empty[:3]}): were the heads saved while "
                         "sharded (FSDP) without gathering their parameters?")
    bad = [f"{k} {tuple(v.shape)}" for k, v in sd.items() if v.dim() != (1 if k.endswith(".bias") else 2)]
    if bad:
        raise ValueError(f"the Medusa heads file has mis-shaped tensors: {bad[:3]} (biases are 1-D, weights 2-D)")


def implied_by_file(raw: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """MedusaConfig fields that `raw` (a config.json) leaves out and the heads file settles.

    Without `medusa_num_layers` or `version` the config says nothing about them (a hand-written config, another
    tool's), and the file has only one reading; TGI too picks its V1/V2 head by the keys it finds. A present value
    that contradicts the file still raises in `config_from_state_dict`.
    """
    _, layers, shared = file_layout(sd)
    implied: dict[str, Any] = {}
    if "medusa_num_layers" not in raw:
        implied["num_layers"] = layers
    if "version" not in raw:
        implied["share_lm_head"] = shared
    return implied


def config_from_state_dict(config: MedusaConfig, sd: dict[str, torch.Tensor]) -> MedusaConfig:
    """`config` with num_heads / num_layers / share_lm_head / sizes made consistent with the tensors on disk."""
    heads, layers, shared = file_layout(sd)
    if heads != config.num_heads:
        warnings.warn(f"config.json says medusa_num_heads={config.num_heads} but the file holds {heads} heads; "
                      "using the file's count")
    if layers != config.num_layers or shared != config.share_lm_head:
        raise ValueError(f"config.json (num_layers={config.num_layers}, shared lm_head={config.share_lm_head}) "
                         f"disagrees with the heads file (num_layers={layers}, shared lm_head={shared})")
    hidden = sd["0.0.linear.weight"].shape[1] if layers else sd["0.0.weight"].shape[1]
    vocab = config.vocab_size if shared else sd[f"0.{layers}.weight"].shape[0]
    for name, disk, cfg in (("hidden_size", hidden, config.hidden_size), ("vocab_size", vocab, config.vocab_size)):
        if cfg and cfg != disk:
            raise ValueError(f"config.json {name}={cfg} but the heads file has {disk}")
    return dataclasses.replace(config, num_heads=heads, hidden_size=hidden, vocab_size=vocab)


def build_heads(config: MedusaConfig, sd: dict[str, torch.Tensor], base_lm_head: torch.nn.Linear | None = None, *,
                dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> MedusaHeads:
    """MedusaHeads holding exactly `sd` (strict), built on the meta device so nothing is initialised twice."""
    if config.share_lm_head:
        if base_lm_head is None:
            raise ValueError("these Medusa heads share the base lm_head (version 2): pass the base model")
        dtype = dtype or base_lm_head.weight.dtype
        device = base_lm_head.weight.device if device is None else device
        if not config.vocab_size:
            config = dataclasses.replace(config, vocab_size=base_lm_head.weight.shape[0])
    heads = MedusaHeads(config, base_lm_head if config.share_lm_head else None, device="meta", dtype=dtype)
    sd = {k: v.to(device="cpu" if device is None else device, dtype=dtype or v.dtype) for k, v in sd.items()}
    heads.load_state_dict(sd, strict=True, assign=True)
    return heads


def load_heads(directory: str, base_lm_head: torch.nn.Linear | None = None, *, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> MedusaHeads:
    """Load format-B (or v0.1) heads from `directory`; `base_lm_head` is required for shared-lm_head heads."""
    raw = read_json(os.path.join(directory, CONFIG_NAME))
    sd = load_heads_state_dict(directory)
    config = config_from_state_dict(MedusaConfig.from_json_dict(raw, **implied_by_file(raw, sd)), sd)
    return build_heads(config, sd, base_lm_head, dtype=dtype, device=device)
