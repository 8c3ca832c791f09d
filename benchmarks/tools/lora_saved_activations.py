"""Bytes saved for backward per token per decoder layer in a LoRA training step: ours (fused LoRA, and QLoRA) against
HF + PEFT, at real layer shapes (one layer, small vocabulary; bf16 weights, fp32 adapters, r=16 on every linear).

Runs on the CPU with TRITON_INTERPRET=1 (set before Triton is imported), so our kernels' autograd Functions save
exactly what they save on CUDA. Every tensor autograd saves passes a ``saved_tensors_hooks`` pack hook; storages are
counted once, parameters and buffers not at all (they exist anyway), a dequantised NF4 weight would count.

    python benchmarks/tools/lora_saved_activations.py [--config qwen2.5-7b] [--seq 128]
    python benchmarks/tools/lora_saved_activations.py --config qwen3-30b-a3b-w4l --seq 64   # MoE: experts adapted
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_lora import ALPHA, CONFIGS, R, TARGETS  # noqa: E402


def saved_bytes(model, ids, exclude: set[int]) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="qwen2.5-7b", choices=sorted(CONFIGS))
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    cfg = {**CONFIGS[args.config], "num_hidden_layers": 2, "vocab_size": 512}
    ids = torch.randint(0, cfg["vocab_size"], (1, args.seq))
    results = {}
    for provider in ("hf_peft", "ours", "ours_qlora"):
        torch.manual_seed(0)
        if provider == "hf_peft":
            import peft
            import transformers

            config = transformers.AutoConfig.for_model(**cfg)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                  attn_implementation="sdpa")
            moe = "num_experts_per_tok" in cfg  # all-linear there: the routers and expert stacks, as ours
            model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                               target_modules="all-linear" if moe else TARGETS))
        else:
            from liger_models.auto import model_class
            from liger_models.lora import LoraSettings, add_lora, quantize_base_

            cls = model_class(cfg["model_type"])
            model = cls.from_config(cls.config_class.from_hf(dict(cfg)), dtype=torch.bfloat16)
            if provider == "ours_qlora":
                quantize_base_(model)
            add_lora(model, LoraSettings(r=R, alpha=ALPHA, targets="all-linear"))
        model.train()
        exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        one = saved_bytes(model, ids, exclude)
        results[provider] = one
        print(f"{provider:12s} {one / args.seq / cfg['num_hidden_layers'] / 1024:8.1f} KiB/token/layer "
              f"(both layers, embedding and loss included)", flush=True)


if __name__ == "__main__":
    main()
