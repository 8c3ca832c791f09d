"""The rate of every GEMM a training step runs, at the e2e configs' shapes and in the layouts the step uses them.

Per decoder layer the step runs, for each projection (qkv, o, gate_up, down) with W (M, K) and N tokens:
forward  out = x · Wᵀ   (x (N, K) row-major, W row-major)      — `fwd`
dX       dx  = g · W    (g (N, M) row-major)                   — `dx`
dW       dW  = gᵀ · x   (a transposed view of g)               — `dw`
plus the lm_head's chunk GEMMs. Each is timed as used, and in variants a caller could choose without changing any
layout: the same product split in two along M or N (two launches, each writing its half of the output), and under
`allow_bf16_reduced_precision_reduction=False` (what the one-chunk linear-CE dW runs under). Prints TFLOP/s per
GEMM; the e2e question is whether any variant beats the default at the shapes that dominate a step.

    python benchmarks/bench_gemm_shapes.py --out DIR [--configs mistral-7b-w4l,llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import CONFIGS  # noqa: E402


def projections(cfg: dict) -> dict[str, tuple[int, int]]:
    """name → (M, K) of the weight, as the step packs them."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    return {"qkv": ((hq + 2 * hkv) * d, h), "o": (h, hq * d), "gate_up": (2 * i, h), "down": (h, i)}


def products(kind: str, n: int, m: int, k: int):
    """(a, b, out) with out = a · b in the step's layout for fwd / dx / dw of a W (m, k) over n tokens."""
    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    if kind == "fwd":
        return bf16(n, k), bf16(m, k).t(), torch.empty(n, m, device="cuda", dtype=torch.bfloat16)
    if kind == "dx":
        return bf16(n, m), bf16(m, k), torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    return bf16(n, m).t(), bf16(n, k), torch.empty(m, k, device="cuda", dtype=torch.bfloat16)


def variants(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> dict:
    rows, cols = out.shape

    def whole():
        torch.mm(a, b, out=out)

    def split_rows():  # two launches, each over half of out's rows (contiguous halves)
        h = rows // 2
        torch.mm(a[:h], b, out=out[:h])
        torch.mm(a[h:], b, out=out[h:])

    def split_cols():  # two launches over column halves (strided output views)
        h = cols // 2
        torch.mm(a, b[:, :h], out=out[:, :h])
        torch.mm(a, b[:, h:], out=out[:, h:])

    def fp32_split_k():
        matmul = torch.backends.cuda.matmul
        allowed = matmul.allow_bf16_reduced_precision_reduction
        matmul.allow_bf16_reduced_precision_reduction = False
        try:
            torch.mm(a, b, out=out)
        finally:
            matmul.allow_bf16_reduced_precision_reduction = allowed

    return {"as used": whole, "split rows": split_rows, "split cols": split_cols, "fp32 split-K": fp32_split_k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--configs", default="mistral-7b-w4l,llama-3-8b-w8l,llama-3.2-1b")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name in args.configs.split(","):
        cfg, batch, seq = CONFIGS[name]
        n = batch * seq
        shapes = dict(projections(cfg))
        lm_rows = cfg["hidden_size"]  # the linear-CE chunk (grad_W's storage as scratch: H rows of V)
        shapes["lm_head chunk"] = (cfg["vocab_size"], cfg["hidden_size"])
        for proj, (m, k) in shapes.items():
            tokens = lm_rows if proj == "lm_head chunk" else n
            for kind in ("fwd", "dx", "dw"):
                a, b, out = products(kind, tokens, m, k)
                flop = 2.0 * tokens * m * k
                row = dict(config=name, gemm=proj, kind=kind, n=tokens, m=m, k=k)
                for label, fn in variants(a, b, out).items():
                    ms = do_bench(fn, warmup=50, rep=200)
                    row[label] = round(flop / ms / 1e9, 1)  # TFLOP/s
                rows.append(row)
                print(json.dumps(row), flush=True)
                del a, b, out
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gemm_shapes.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    labels = ["as used", "split rows", "split cols", "fp32 split-K"]
    print("| config | GEMM | N×M×K | " + " | ".join(labels) + " |\n|---|---|---|" + "---|" * len(labels))
    for r in rows:
        best = max(r[lab] for lab in labels)
        cells = [f"**{r[lab]:.0f}**" if r[lab] == best else f"{r[lab]:.0f}" for lab in labels]
        print(f"| {r['config']} | {r['gemm']} {r['kind']} | {r['n']}×{r['m']}×{r['k']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
