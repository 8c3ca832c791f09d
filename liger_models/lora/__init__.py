"""LoRA and QLoRA on the fused models: adapters inside the packed projections (modules/lora_linear.py), PEFT's
file format, merged export, NF4 bases (quantised on load or read from bitsandbytes 4-bit checkpoints)."""

from .attach import add_lora, lora_modules, lora_state_dict, merge_lora, quantize_base_, unmerge_lora
from .config import ALL_LINEAR, LoraSettings, resolve_targets
from .peft_format import load_adapter, merged_state_dict, read_adapter, save_adapter, save_merged
from .qlora import load_bnb_4bit, load_causal_lm, save_bnb_4bit

__all__ = ["ALL_LINEAR", "LoraSettings", "add_lora", "load_adapter", "load_bnb_4bit", "load_causal_lm", "lora_modules",
           "lora_state_dict", "merge_lora", "merged_state_dict", "quantize_base_", "read_adapter", "resolve_targets",
           "save_adapter", "save_bnb_4bit", "save_merged", "unmerge_lora"]
