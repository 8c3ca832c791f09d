"""LoRA's dropout on an adapter's input at a Llama-3.1-8B step's shapes (8192 tokens, r = 16, bf16): the three
products that use the mask (kernels/ops/dropout_matmul.py) with it drawn inside, against the same products made as
a dropped copy per adapter (the elementwise kernel) followed by cuBLAS, and against no dropout at all (one cuBLAS
GEMM for the group: the floor a fused product can approach). Plus the elementwise mask alone next to torch's
dropout and a plain scaled copy.

Groups: q|k|v (4096 columns, three adapters), gate|up (4096, two), o (4096, one), down (14336, one).
Products: forward xa = drop_i(x)·A_iᵀ; dX's out += Σ_i drop_i(d_i·A_i); dA's d_iᵀ·drop_i(x) (fp32 out).

    python benchmarks/bench_dropout.py [--out DIR] [--providers fused,two-pass,no-dropout]
"""

from __future__ import annotations

import torch
from harness import apply_tunables, copy_bandwidth_gbs, parse_args, run_case, save, table

TOKENS, RANK, RATE = 8192, 16, 0.1
GROUPS = {"qkv": (4096, 3), "gate_up": (4096, 2), "o": (4096, 1), "down": (14336, 1)}


def main() -> None:
    args = parse_args(__doc__)
    from liger_models.kernels.ops import dropout as dr
    from liger_models.kernels.ops import dropout_matmul as dm

    wanted = {p for p in args.providers.split(",") if p}
    tuned = apply_tunables()  # LIGER_TUNE=dropout_matmul.forward_block_m=16,... for a variant
    gbs = copy_bandwidth_gbs()
    results, floors = [], {}
    for group, (cols, adapters) in GROUPS.items():
        ranks = [RANK] * adapters
        x = torch.randn(TOKENS, cols, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(RANK * adapters, cols, device="cuda", dtype=torch.bfloat16) * 0.02
        d = torch.randn(TOKENS, RANK * adapters, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(TOKENS, cols, device="cuda", dtype=torch.bfloat16)
        draws = dr.draws_for(x, [RATE] * adapters)
        shape = {"tokens": TOKENS, "cols": cols, "adapters": adapters, "rank": RANK, "p": RATE}
        cases = {
            "forward": {"fused": lambda: dm.dropped_matmul(x, a, ranks, draws),
                        "two-pass": lambda: dm.dropped_matmul_reference(x, a, ranks, draws),
                        "no-dropout": lambda: x @ a.t()},
            "dx": {"fused": lambda: dm.dropped_matmul_add(out, d, a, ranks, draws),
                   "two-pass": lambda: dm.dropped_matmul_add_reference(out, d, a, ranks, draws),
                   "no-dropout": lambda: out.addmm_(d, a)},
            "dA": {"fused": lambda: dm.dropped_matmul_t(d, x, ranks, draws),
                   "two-pass": lambda: dm.dropped_matmul_t_reference(d, x, ranks, draws),
                   "no-dropout": lambda: d.t() @ x},
        }
        for product, providers in cases.items():
            case = f"{group}-{product}"
            moved = x.numel() * x.element_size() * (2 if product == "dx" else 1)  # x read (out read and written)
            floors[case] = moved / (gbs * 1e9) * 1e3
            results += run_case(case, providers, dict(shape, product=product), wanted)
    for cols in (4096, 14336):  # the mask alone: one read and one write an element
        t = torch.randn(TOKENS, cols, device="cuda", dtype=torch.bfloat16)
        seed = dr.new_seeds(1, t.device)
        case = f"elementwise-{cols}"
        floors[case] = 2 * t.numel() * t.element_size() / (gbs * 1e9) * 1e3
        results += run_case(case, {"seeded_dropout": lambda: dr.seeded_dropout(t, seed, RATE),
                                   "torch-dropout": lambda: torch.nn.functional.dropout(t, RATE),
                                   "scaled-copy": lambda: t * (1 / (1 - RATE))},
                            {"tokens": TOKENS, "cols": cols, "p": RATE}, wanted and {"seeded_dropout"})
    save("bench_dropout", args.out, results, {"copy_gbs": gbs, "tuned": tuned})
    print(table(results, floors))


if __name__ == "__main__":
    main()
