"""NF4 dequantisation (the QLoRA base's weight, rebuilt in forward and again in backward of every adapted linear):
this project's Triton kernel vs its PyTorch reference and bitsandbytes' ``dequantize_4bit``, bf16 out.

Shapes: the linears of Llama-3.1-8B (q/o 4096², k|v 1024×4096, gate|up / down 14336×4096) and Qwen2.5-7B's MLP
(18944×3584). Bytes: 0.5 per weight of codes and 4 per 64 weights of fp32 block scales read, 2 per weight written;
floor = bytes / copy bandwidth measured in the same run. bitsandbytes runs from its own 4-bit state (its double-
quantised scales are dequantised inside its call; ours were expanded to fp32 at load, what the model holds).

    python benchmarks/bench_nf4.py [--out DIR] [--providers liger-models,reference,bitsandbytes]
"""

from __future__ import annotations

import torch
from harness import copy_bandwidth_gbs, parse_args, run_case, save, table

SHAPES = {"8b-q_proj": (4096, 4096), "8b-kv": (1024, 4096), "8b-mlp": (14336, 4096), "7b-mlp": (18944, 3584)}


def main() -> None:
    args = parse_args(__doc__)
    from liger_models.kernels.ops import nf4

    wanted = {p for p in args.providers.split(",") if p}
    try:
        import bitsandbytes.functional as bnb
    except Exception:  # noqa: BLE001 - a missing peer is reported as missing
        bnb = None
    gbs = copy_bandwidth_gbs()
    results, floors = [], {}
    for case, shape in SHAPES.items():
        w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
        codes, absmax = nf4.quantize_nf4(w)
        providers = {
            "liger-models": lambda: nf4.dequantize_nf4(codes, absmax, shape, torch.bfloat16),
            "reference": lambda: nf4.dequantize_nf4_reference(codes, absmax, shape, torch.bfloat16),
        }
        if bnb is not None:
            q, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
            providers["bitsandbytes"] = lambda: bnb.dequantize_4bit(q, state)
        n = w.numel()
        floors[case] = (n / 2 + n / 64 * 4 + 2 * n) / (gbs * 1e9) * 1e3
        results += run_case(case, providers, {"shape": list(shape)}, wanted)
    save("bench_nf4", args.out, results, {"copy_gbs": gbs})
    print(table(results, floors))


if __name__ == "__main__":
    main()
