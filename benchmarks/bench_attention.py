"""Causal attention forward + backward at the bench_e2e configs' shapes, per SDPA backend (cuDNN, FlashAttention-2,
memory-efficient): which one a training step should ask for, per head_dim and GQA ratio.

Inputs are laid out as the model's (liger_models/modules/attention.py): q, k, v are (B, T, H, D) head views of one
packed qkv projection output, handed to SDPA transposed to (B, H, T, D), bf16, is_causal, enable_gqa. Time: median
of do_bench for forward + backward; TFLOP/s counts the causal half of 4·B·Hq·T²·D per pass (3.5 passes:
forward, and a backward that recomputes the scores).

    python benchmarks/bench_attention.py [--out DIR]
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from harness import median_ms, parse_args
from torch.nn.attention import SDPBackend, sdpa_kernel

# config: (batch, seq, q heads, kv heads, head_dim), as bench_e2e.CONFIGS
SHAPES = {
    "llama-3.2-1b": (8, 2048, 32, 8, 64),
    "qwen2.5-1.5b": (8, 2048, 12, 2, 128),
    "gemma-2b": (8, 2048, 8, 1, 256),
    "llama-3-8b-w8l": (4, 2048, 32, 8, 128),
    "mistral-7b-w4l": (4, 4096, 32, 8, 128),
    "phi3-mini-w8l": (8, 2048, 32, 32, 96),
}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}


def step(shape: tuple, backend):
    b, t, hq, hkv, d = shape
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)

    def run():
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q, k, v = (x.unflatten(-1, (-1, d)).transpose(1, 2) for x in (q, k, v))
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
        else:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
        return torch.autograd.grad(out, qkv, dout)

    return run


def main() -> None:
    args = parse_args(__doc__)
    rows = []
    for name, shape in SHAPES.items():
        b, t, hq, hkv, d = shape
        flop = 3.5 * 4 * b * hq * t * t * d / 2
        row = {"config": name, "shape": shape}
        for label, backend in BACKENDS.items():
            try:
                ms = median_ms(step(shape, backend))
                row[label] = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1)}
            except Exception as e:  # noqa: BLE001 - a backend that does not take this shape is a result too
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            torch.cuda.empty_cache()
        rows.append(row)
        cells = [f"{k} {v['ms']:.3f} ms ({v['tflops']:.0f} TFLOP/s)" if "ms" in v else f"{k} —"
                 for k, v in row.items() if k in BACKENDS]
        print(f"{name} {shape}: " + ", ".join(cells), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
