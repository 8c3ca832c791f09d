"""What bounds a training step's tokens/s (issue 6): the highest rate each config could reach with the GEMMs,
attention and optimizer it runs now, from a profile_e2e.py JSON.

A step must at least run its matmuls (already at cuBLAS's best kernel: bench_gemm_shapes.py), its attention (cuDNN,
the fastest SDPA backend: bench_attention.py) and its optimizer update (at the copy rate: FusedAdamW). Everything
else — norms, gated activations, RoPE, the CE kernel, copies, host gaps — is what fusion can still remove. So:

  ceiling  = tokens / (GEMM + attention + optimizer)          the rate with every other kernel and gap gone
  GPU-busy = tokens / (all kernel time)                        the rate with the host fully hidden (CUDA graph)
  step     = tokens / (the profiled step's wall time)

A target above the ceiling cannot be met without faster matmuls or attention than the libraries provide here.

With --e2e (bench_e2e.py JSONs holding `ours` and `hf_liger` rows), the bound on issue 6's ratio target: single
profiled steps vary by several percent, so only our own fixed share f = fixed / profiled step (first kernel to
last) is taken from the profile, and R = ours ÷ Liger tokens/s from the timed steps. With every other kernel and gap
gone and the fixed kernels at their speed, ours ÷ Liger would reach R / f; 1.15× leaves the rest R / 1.15 − f of
today's step.
With --peer (a profile_e2e.py JSON of another provider, e.g. hf_liger), the GEMM and attention kernels both steps
run (same name, same calls per step), timed in each: under the H200's power cap the same kernel runs at the clocks
its neighbours leave it.

    python benchmarks/tools/step_ceiling.py PROFILE.json [PROFILE.json ...]   (later files win per config)
        [--e2e BENCH_E2E.json ...] [--peer PEER_PROFILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*
from bench_e2e import CONFIGS  # noqa: E402

# issue 6's targets: 1.15× HF + liger-kernel's measured tokens/s
TARGET_TOK_S = {"llama-3.2-1b": 75_000, "qwen2.5-1.5b": 58_000, "gemma-2b": 38_400, "llama-3-8b-w8l": 42_300,
                "mistral-7b-w4l": 100_000, "phi3-mini-w8l": 89_800}
FIXED = ("GEMM", "attention", "optimizer")
RATIO_TARGET = 1.15  # issue 6: 1.15x HF + liger-kernel's tokens/s
LIBRARY_KERNELS = ("nvjet", "cutlass", "gemm", "sdpa", "flash", "fmha")  # cuBLAS GEMMs and cuDNN/flash attention


def fixed_ms(row: dict) -> float:
    """GEMM + attention + optimizer time of a profiled step."""
    return sum(row["categories"].get(c, 0.0) for c in FIXED)


def bounds(row: dict) -> dict:
    _, batch, seq = CONFIGS[row["config"]]
    tokens = batch * seq
    fixed = fixed_ms(row)
    rest_ms = row["gpu_busy_ms"] - fixed
    return dict(config=row["config"], fixed_ms=fixed, rest_ms=rest_ms, host_gap_ms=row["host_gap_ms"],
                ceiling=tokens / fixed * 1e3, gpu_busy=tokens / row["gpu_busy_ms"] * 1e3,
                step=tokens / row["step_ms"] * 1e3, target=TARGET_TOK_S.get(row["config"]),
                # what the non-fixed kernels plus the gap may take at most for the target step time
                allowed_rest_ms=(tokens / TARGET_TOK_S[row["config"]] * 1e3 - fixed
                                 if row["config"] in TARGET_TOK_S else None))


def _load(paths: list[str]) -> dict[str, dict]:
    rows = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f):
                rows[row["config"]] = row
    return rows


def ratio_bound(row: dict, ratio: float) -> dict:
    """R / f and the rest 1.15x allows (fractions of our profiled step), from our fixed share f and ratio R."""
    f = fixed_ms(row) / row["idle"]["span_ms"]
    allowed = ratio / RATIO_TARGET - f
    return dict(fixed_share=f, most=ratio / f, allowed=allowed,
                cut=None if allowed <= 0 else 1 - allowed / (1 - f))


def matched_kernels(ours: dict, peer: dict) -> tuple[int, float, float]:
    """(count, our ms, peer ms) over the library GEMM/attention kernels both steps call equally often."""
    mine = {(k["name"], k["calls"]): k["ms"] for k in ours["top_kernels"]}
    theirs = {(k["name"], k["calls"]): k["ms"] for k in peer["top_kernels"]}
    keys = [k for k in mine if k in theirs and any(n in k[0] for n in LIBRARY_KERNELS)]
    return len(keys), sum(mine[k] for k in keys), sum(theirs[k] for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--e2e", nargs="*", default=[], help="bench_e2e.py JSONs with ours and hf_liger rows")
    ap.add_argument("--peer", help="a profile_e2e.py JSON of another provider, same configs")
    args = ap.parse_args()
    rows = _load(args.profiles)
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
    if args.e2e:
        e2e = {}
        for path in args.e2e:
            with open(path) as f:
                for r in json.load(f)["results"]:
                    if "tokens_per_s" in r:
                        e2e[(r["config"], r["provider"])] = r["tokens_per_s"]
        print(f"\n| config | fixed share f | R (ours ÷ Liger) | most ours ÷ Liger can reach (R / f) "
              f"| the rest allowed at {RATIO_TARGET}x | cut the rest needs |")
        print("|---|---|---|---|---|---|")
        for name, row in rows.items():
            if (name, "ours") not in e2e or (name, "hf_liger") not in e2e or not row.get("idle"):
                continue
            ratio = e2e[(name, "ours")] / e2e[(name, "hf_liger")]
            b = ratio_bound(row, ratio)
            cut = "—" if b["cut"] is None else f"{b['cut']:.0%}"
            allowed = "none" if b["allowed"] <= 0 else f"{b['allowed']:.1%}"
            print(f"| {name} | {b['fixed_share']:.1%} | {ratio:.3f}x | {b['most']:.3f}x | {allowed} | {cut} |")
    if args.peer:
        peers = _load([args.peer])
        print("\n| config | matched GEMM + attention kernels | ours ms | peer ms | ours ÷ peer |")
        print("|---|---|---|---|---|")
        for name, row in rows.items():
            if name in peers:
                n, mine, theirs = matched_kernels(row, peers[name])
                if n:
                    print(f"| {name} | {n} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.3f} |")


if __name__ == "__main__":
    main()
