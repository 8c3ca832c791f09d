"""Soft-capped causal attention (Gemma 2: scores ← c·tanh(scores / c) before the mask), forward + backward, at the
bench_e2e Gemma 2 shapes: the two paths modules/attention.py can take, next to SDPA without the cap as the floor.

  kernel this project's Triton FlashAttention with the cap (liger_models/kernels/ops/softcap_attention.py)
  flex   torch.compile(flex_attention) with the soft-cap score_mod and a causal (± window) BlockMask: what a CUDA
         call of FLEX_MIN_LEN+ queries runs unless the kernel is preferred
  math   attend_softcapped_math: HF eager's op order, (B, Hq, T, T) scores in bf16 (the short-call / CPU path)
  sdpa   F.scaled_dot_product_attention without the cap (not Gemma 2's numerics: what the cap costs)

Inputs as the model lays them out (bench_attention.py): (B, T, H, D) views of one packed qkv output, bf16. Time:
median of do_bench; peak: extra memory over the inputs. H200 numbers: BENCHMARKS.md, "Soft-capped attention".

    python benchmarks/bench_softcap_attention.py [--out DIR]
"""

from __future__ import annotations

import json
import os

import torch
from harness import median_ms, parse_args, peak_extra_mib

from liger_models.modules.attention import AttentionMask, attend, attend_softcapped_math

# name: (batch, seq, q heads, kv heads, head_dim, window or None, softcap, query_pre_attn_scalar)
SHAPES = {
    "gemma2-9b-full": (4, 2048, 16, 8, 256, None, 50.0, 256),
    "gemma2-9b-window-1024": (4, 4096, 16, 8, 256, 1024, 50.0, 256),
    "gemma2-2b-full": (8, 2048, 8, 4, 256, None, 50.0, 256),
    "gemma2-27b-full": (2, 4096, 32, 16, 128, None, 50.0, 144),
}


def step(shape: tuple, path: str):
    b, t, hq, hkv, d, window, cap, qpas = shape
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    scale = qpas**-0.5
    mask = AttentionMask(t, 0, None, qkv.device)

    def run():
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
        q, k, v = (x.view(b, t, -1, d).transpose(1, 2) for x in (q, k, v))
        if path == "kernel":
            out = attend(q, k, v, mask, window, scale, flex="kernel", softcap=cap)
        elif path == "flex":
            out = attend(q, k, v, mask, window, scale, flex="always", softcap=cap)
        elif path == "math":
            out = attend_softcapped_math(q, k, v, mask.boolean(window), scale, cap)
        else:
            out = attend(q, k, v, mask, window, scale, flex="auto")
        return torch.autograd.grad(out, qkv, dout)

    return run


def main() -> None:
    args = parse_args(__doc__)
    paths = [p for p in (args.providers.split(",") if args.providers else ("kernel", "flex", "sdpa", "math"))]
    rows = []
    for name, shape in SHAPES.items():
        b, t, hq, _, d, window, _, _ = shape
        keys = t if window is None else min(window, t)
        flop = 3.5 * 4 * b * hq * t * keys * d / (2 if window is None else 1)  # the causal half, or the band
        row = {"config": name, "shape": shape}
        for path in paths:
            try:
                fn = step(shape, path)
                ms = median_ms(fn)
                row[path] = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1),
                             "peak_mib": round(peak_extra_mib(fn), 1)}
            except Exception as e:  # noqa: BLE001 - a path that runs out of memory at this shape is a result too
                row[path] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            torch.cuda.empty_cache()
        rows.append(row)
        cells = [f"{k} {v['ms']:.3f} ms ({v['tflops']:.0f} TFLOP/s, +{v['peak_mib']:.0f} MiB)" if "ms" in v
                 else f"{k} {v['error']}" for k, v in row.items() if k in paths]
        print(f"{name} {shape}: " + ", ".join(cells), flush=True)
        # Written after every shape: a run stopped by a time limit keeps the shapes it finished.
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "softcap_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
