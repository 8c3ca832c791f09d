"""LoRA in the training recipes: ``--lora-*`` options as LoraSettings, adapters on the loaded base (restored when
resuming), and ``liger-models merge-lora``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from liger_models.hub import ADAPTER_CONFIG, is_bnb_4bit, named_base, read_config, resolve_model
from liger_models.lora import (add_lora, load_adapter, load_causal_lm, LoraSettings, quantize_base_, read_adapter,
                               save_merged)
from liger_models.lora.attach import lora_state_dict
from liger_models.lora.config import parse_indices
from liger_models.modules.lora_linear import NF4Weight
from liger_models.recipes import training as T
from liger_models.train import checkpointing as ckpt


def lora_settings(config):
    """The config's --lora-* options as LoraSettings, or None without lora_r (full fine-tuning)."""
    if config.lora_r is None:
        return None
    targets = config.lora_targets if config.lora_targets == "all-linear" else _names(config.lora_targets)
    alpha = config.lora_alpha if config.lora_alpha is not None else 2.0 * config.lora_r
    return LoraSettings(r=config.lora_r, alpha=alpha, dropout=config.lora_dropout, targets=targets,
                        use_rslora=config.lora_rslora, use_dora=config.lora_dora,
                        modules_to_save=_names(config.lora_modules_to_save or ""),
                        layers_to_transform=None if config.lora_layers is None else parse_indices(config.lora_layers),
                        trainable_token_indices=(None if config.lora_token_rows is None
                                                 else parse_indices(config.lora_token_rows, "token")))


def load_base(path: Path, dtype: torch.dtype | None, device, lora: LoraSettings | None, *,
              trains_base: bool = True, quantise: bool = False):
    """``--model``'s model as stored (``load_causal_lm``; ``quantise``: its NF4 base, quantised as it loads). A
    bitsandbytes 4-bit checkpoint (what QLoRA users download) is an NF4 base, which trains through adapters only: a
    run that trains the base (``trains_base``: not Medusa's stage 1) without ``lora`` is refused by name."""
    if trains_base and lora is None and is_bnb_4bit(read_config(path)):
        raise ValueError(f"--model {path} is a bitsandbytes 4-bit checkpoint, whose NF4 weights train through "
                         "adapters only: give --lora-r (or train the unquantized checkpoint in full)")
    return load_causal_lm(path, dtype=dtype, device=device, quantise=quantise)


def quantises_as_it_loads(qlora: bool, world_size: int) -> bool:
    """Whether a --qlora run loads its base already quantised (``load_causal_lm``'s ``quantise``): in one process.
    Under torchrun every rank would hold a dense copy in host memory at once (8 × 16 GiB for an 8B base on 8 GPUs),
    so there each quantises the base it loads onto its own GPU (``attach``)."""
    return qlora and world_size == 1


def _names(text: str) -> list[str]:
    """A comma-separated option's names."""
    return [name.strip() for name in text.split(",") if name.strip()]


def attach(model, settings, qlora: bool, resume: Path | None) -> None:
    """NF4 base with ``qlora``, adapters on the targets (everything else frozen); resuming, the checkpoint's adapter
    weights exactly as saved (fp32)."""
    if qlora:
        quantize_base_(model)
    add_lora(model, settings)
    if resume is not None:
        _, tensors = read_adapter(resume)
        ours = lora_state_dict(model)
        if set(tensors) != set(ours) or any(tensors[k].shape != ours[k].shape for k in ours):
            raise ValueError(f"--resume: {resume} holds adapters for other modules or ranks than --lora-* give")
        with torch.no_grad():
            for key, param in ours.items():
                param.copy_(tensors[key])


def trained_on_nf4(adapter: Path) -> bool:
    """Whether ``adapter`` is a checkpoint of a `--qlora` run, as its trainer_state.pt records: its adapters trained
    against dequant(NF4(base)), not the dense base. False for an adapter saved elsewhere (no trainer_state.pt)."""
    if not (adapter / ckpt.STATE_FILE).is_file():
        return False
    try:
        lora = (ckpt.load_trainer_state(adapter, mmap=True).get("settings") or {}).get("lora")
    except ValueError:  # unreadable: the adapter files are what counts here; resuming from it says what is wrong
        return False
    return isinstance(lora, dict) and bool(lora.get("qlora"))


def dense_base_note(adapter: Path | None, base: torch.nn.Module) -> str | None:
    """The line to print when ``adapter`` trained with --qlora and goes onto ``base`` with dense weights (neither
    --qlora-base nor stored in 4 bits): the result is then not the model training computed."""
    nf4 = any(isinstance(m, NF4Weight) for m in base.modules())
    if adapter is None or nf4 or not trained_on_nf4(adapter):
        return None
    return (f"[adapter] {adapter} trained with --qlora, against its base quantised to NF4; it goes onto the dense "
            "base here (--qlora-base: onto the NF4 base it trained against)")


def merge_lora_command(args: argparse.Namespace) -> Path:
    """``liger-models merge-lora``: --adapter merged into its base (--model or the adapter's base_model_name_or_path),
    written with the base's tokenizer files to --out."""
    adapter = Path(args.adapter).expanduser()
    model_dir = (resolve_model(args.model) if args.model is not None
                 else named_base(adapter, ADAPTER_CONFIG, "--adapter"))
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = load_base(model_dir, dtype, None, read_adapter(adapter)[0], quantise=args.qlora_base)
    note = dense_base_note(adapter, model)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    load_adapter(model, adapter)
    out = Path(args.out).expanduser()
    save_merged(model, out, dtype=dtype)
    T.copy_tokenizer(model_dir, out)
    return out
