"""What bounds a training step's tokens/s (issue 6): the highest rate each config could reach with the GEMMs,
attention and optimizer it runs now, from a profile_e2e.py JSON.

A step must at least run its matmuls (already at cuBLAS's best kernel: bench_gemm_shapes.py), its attention (cuDNN,
the fastest SDPA backend: bench_attention.py) and its optimizer update (at the copy rate: FusedAdamW). Everything
else — norms, gated activations, RoPE, the CE kernel, copies, host gaps — is what fusion can still remove. So:

  ceiling  = tokens / (GEMM + attention + optimizer)          the rate with every other kernel and gap gone
  GPU-busy = tokens / (all kernel time)                        the rate with the host fully hidden (CUDA graph)
  step     = tokens / (the profiled step's wall time)

A target above the ceiling cannot be met without faster matmuls or attention than the libraries provide here.

    python benchmarks/step_ceiling.py PROFILE.json [PROFILE.json ...]   (later files win per config)
"""

from __future__ import annotations

import json
import sys

from bench_e2e import CONFIGS

# issue 6's targets: 1.15× HF + liger-kernel's measured tokens/s
TARGET_TOK_S = {"llama-3.2-1b": 75_000, "qwen2.5-1.5b": 58_000, "gemma-2b": 38_400, "llama-3-8b-w8l": 42_300,
                "mistral-7b-w4l": 100_000, "phi3-mini-w8l": 89_800}
FIXED = ("GEMM", "attention", "optimizer")


def bounds(row: dict) -> dict:
    _, batch, seq = CONFIGS[row["config"]]
    tokens = batch * seq
    cats = row["categories"]
    fixed_ms = sum(cats.get(c, 0.0) for c in FIXED)
    rest_ms = row["gpu_busy_ms"] - fixed_ms
    return dict(config=row["config"], fixed_ms=fixed_ms, rest_ms=rest_ms, host_gap_ms=row["host_gap_ms"],
                ceiling=tokens / fixed_ms * 1e3, gpu_busy=tokens / row["gpu_busy_ms"] * 1e3,
                step=tokens / row["step_ms"] * 1e3, target=TARGET_TOK_S.get(row["config"]),
                # what the non-fixed kernels plus the gap may take at most for the target step time
                allowed_rest_ms=(tokens / TARGET_TOK_S[row["config"]] * 1e3 - fixed_ms
                                 if row["config"] in TARGET_TOK_S else None))


def main() -> None:
    rows = {}
    for path in sys.argv[1:]:
        with open(path) as f:
            for row in json.load(f):
                rows[row["config"]] = row
    print("| config | GEMM + attention + optimizer ms | other kernels ms | host gap ms | ceiling tok/s "
          "| GPU-busy tok/s | step tok/s | target | others + gap allowed at the target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows.values():
        b = bounds(row)
        allowed = "—" if b["allowed_rest_ms"] is None else (
            f"{b['allowed_rest_ms']:.1f} ms" if b["allowed_rest_ms"] > 0 else "none: target above the ceiling")
        target = "—" if b["target"] is None else f"{b['target'] / 1e3:.1f}k"
        print(f"| {b['config']} | {b['fixed_ms']:.1f} | {b['rest_ms']:.1f} | {b['host_gap_ms']:.1f} "
              f"| {b['ceiling'] / 1e3:.1f}k | {b['gpu_busy'] / 1e3:.1f}k | {b['step'] / 1e3:.1f}k | {target} "
              f"| {allowed} |")


if __name__ == "__main__":
    main()
