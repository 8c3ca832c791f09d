"""Sibling projections (q|k|v, gate|up) as one GEMM: packed parameters vs separate GEMMs vs cat of weights (bf16).

Forward + backward of ``cat([x W_i^T], -1)`` with HF-named parameters, as the models compute it:
  "packed (aliased)"  liger_models.modules.linear.packed_linear on parameters laid back to back (one GEMM each for
                      y, dX and the stacked dW; what the models use after ``pack_()``)
  "packed (cat)"      the same op when the parameters are not adjacent: it concatenates the weights per call
  "separate"          one nn.Linear per projection, outputs concatenated (HF's layout + a copy of y)
  "separate no-cat"   one nn.Linear per projection, outputs left apart (what HF itself computes)
Shapes are Llama-3-8B's (H 4096: q 4096 + k 1024 + v 1024; gate/up 2 × 14336) and Llama-3.2-1B's.

    python benchmarks/bench_packed_projection.py [--quick] [--out DIR]
"""

from __future__ import annotations

import torch
from harness import parse_args, run_case, save, table
from torch import nn

from liger_models.modules.linear import pack_linears_, packed_linear

CASES = {  # name: (hidden, [out features per sibling])
    "8B qkv": (4096, [4096, 1024, 1024]),
    "8B gate|up": (4096, [14336, 14336]),
    "1B qkv": (2048, [2048, 512, 512]),
    "1B gate|up": (2048, [8192, 8192]),
}


def providers(hidden: int, outs: list[int], tokens: int) -> dict:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def linears(packed: bool) -> list[nn.Linear]:
        mods = [nn.Linear(hidden, o, bias=False, device="cuda", dtype=torch.bfloat16) for o in outs]
        if packed:
            pack_linears_(mods)
        return mods

    def step(fn, mods):
        params = [m.weight for m in mods]

        def run():
            y = fn(x, mods)
            ys = y if isinstance(y, tuple) else (y,)
            torch.autograd.grad(ys, [x, *params], [torch.ones_like(t) for t in ys])

        return run

    return {
        "packed (aliased)": step(packed_linear, linears(True)),
        "packed (cat)": step(packed_linear, linears(False)),
        "separate": step(lambda x, ms: torch.cat([m(x) for m in ms], -1), linears(False)),
        "separate no-cat": step(lambda x, ms: tuple(m(x) for m in ms), linears(False)),
    }


def main() -> None:
    args = parse_args(__doc__)
    token_counts = (8192,) if args.quick else (4096, 16384)
    results = []
    for name, (hidden, outs) in CASES.items():
        for tokens in token_counts:
            results += run_case(f"{name} N={tokens}", providers(hidden, outs, tokens))
    save("packed_projection", args.out, results)
    print(table(results))


if __name__ == "__main__":
    main()
