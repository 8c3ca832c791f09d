"""How much of linear-CE's backward a gradient filter could skip on the benchmark's "peaked" logits, and what skipping
costs the weight gradient. Runs on the CPU (float32, a few hundred tokens suffice: the statistics are per token).

cut-cross-entropy's default (`filter_eps="auto"`: bf16 eps / 32 = 2⁻¹²) skips every (tokens × vocabulary) block of
dlogits = softmax − onehot whose entries are all below the threshold, in both backward GEMMs. This counts such
blocks at several thresholds and block shapes, and measures what dropping them does to dW = dlogitsᵀ·h: the share
of vocabulary rows that get no gradient at all, the share off by more than 1%, and the whole matrix's relative
error. It does the same for linear-CE's own opt-in filter (grad_filter_eps, liger_models/kernels/ops/_grad_filter.py), which skips
whole vocabulary columns of a token chunk ("column of N": all --tokens rows; linear-CE's chunks at H2048 are 2048
rows). Logits: noise plus bench_cross_entropy's Zipf-like per-token bias of up to +20; labels drawn from the
softmax (as for a trained model).

    python benchmarks/tools/gradient_sparsity.py [--tokens 512] [--vocab 128256,256000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch


def zipf_bias(vocab: int, top: float, generator: torch.Generator) -> torch.Tensor:
    """bench_cross_entropy.zipf_bias on the CPU: top·(1 − log(rank)/log V), ranks scattered over the ids."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    bias = torch.empty(vocab)
    bias[torch.randperm(vocab, generator=generator)] = top * (1 - torch.log(ranks) / math.log(vocab))
    return bias


def peaked_dlogits(tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """softmax − onehot(label) for bf16-rounded peaked logits, labels sampled from the softmax."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) + zipf_bias(vocab, 20.0, g)).bfloat16().float()
    d = torch.softmax(logits, -1)
    labels = torch.multinomial(d, 1, generator=g)[:, 0]
    d[torch.arange(tokens), labels] -= 1
    return d


def skipped_blocks(d: torch.Tensor, rows: int, cols: int, eps: float) -> torch.Tensor:
    """(tokens, vocab') bool: entries in a rows × cols block whose |values| are all below eps (vocab': whole
    blocks)."""
    n, v = d.shape[0] // rows * rows, d.shape[1] // cols * cols
    small = d[:n, :v].abs().reshape(n // rows, rows, v // cols, cols).amax(dim=(1, 3)) < eps
    return small.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def measure(tokens: int, vocab: int) -> list[dict]:
    d = peaked_dlogits(tokens, vocab)
    h = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    out = []
    # CCE's tiles, and linear-CE's grad_filter_eps rule: whole columns of a token chunk (liger_models/kernels/ops/_grad_filter.py)
    for rows, cols in ((128, 128), (64, 256), (tokens, 1)):
        for log2_eps in (-12, -16, -24):
            skip = skipped_blocks(d, rows, cols, 2.0**log2_eps)
            dv = d[: skip.shape[0], : skip.shape[1]]
            dw = dv.t() @ h[: skip.shape[0]]
            err = (dv * skip).t() @ h[: skip.shape[0]]  # what the filter drops from dW
            rel = err.norm(dim=1) / dw.norm(dim=1).clamp_min(1e-30)
            block = f"column of {rows}" if cols == 1 else f"{rows}x{cols}"
            out.append(dict(vocab=vocab, block=block, eps=f"2^{log2_eps}",
                            skipped_blocks=round(skip[::rows, ::cols].float().mean().item(), 3),
                            dw_rows_without_gradient=round((rel > 0.999).float().mean().item(), 3),
                            dw_rows_off_by_1pct=round((rel > 0.01).float().mean().item(), 3),
                            dw_relative_error=float(f"{(err.norm() / dw.norm()).item():.2e}")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", default="128256,256000")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    rows = [r for v in args.vocab.split(",") for r in measure(args.tokens, int(v))]
    print("| V | block | eps | blocks skipped | dW rows with no gradient | dW rows off by > 1% | dW relative error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']} | {r['block']} | {r['eps']} | {r['skipped_blocks']:.3f} | "
              f"{r['dw_rows_without_gradient']:.3f} | {r['dw_rows_off_by_1pct']:.3f} | {r['dw_relative_error']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gradient_sparsity.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
