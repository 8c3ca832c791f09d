"""LayerNorm forward + backward: this project vs eager PyTorch (F.layer_norm on bf16, PyTorch's native fused
kernel), torch.compile of it and liger-kernel 0.8.5's LigerLayerNormFunction (bf16, with and without bias).

Bytes (the floor): reads x, writes y, then reads dy and x and writes dx: 10·rows·H B (weights, bias, mean/rstd
and dW/dB partials are < 1% and not counted). floor = bytes / copy bandwidth measured in the same run.

    python benchmarks/bench_layer_norm.py [--quick] [--out DIR] [--providers liger-models,eager,...]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _bandwidth import report, time_case
from harness import copy_bandwidth_gbs, parse_args

HEADLINE = (16384, 4096)
SWEEP = [(16384, 1024), (16384, 8192), (4096, 16384)]
EPS = 1e-5


def providers(rows: int, hidden: int, bias: bool) -> dict:
    from liger_models.kernels.ops.layer_norm import layer_norm

    torch._dynamo.reset()  # a fresh compile per case: past 8 shapes Dynamo would silently run eager
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_().clone()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16().requires_grad_()
    b = (0.1 * torch.randn(hidden, device="cuda")).bfloat16().requires_grad_() if bias else None
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    params = (x, w) + ((b,) if bias else ())

    def eager(x_, w_, b_):
        return F.layer_norm(x_, (hidden,), w_, b_, EPS)

    def liger_kernel(x_, w_, b_):  # LigerLayerNormFunction.apply(X, W, B, eps); it always takes a bias
        import importlib

        fn = importlib.import_module("liger_kernel.ops.layer_norm").LigerLayerNormFunction
        return fn.apply(x_, w_, b_ if b_ is not None else torch.zeros_like(w_), EPS)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(x, w, b), params, dy)

    return {
        "liger-models": fwd_bwd(lambda x_, w_, b_: layer_norm(x_, w_, b_, EPS)),
        "eager": fwd_bwd(eager),
        "torch.compile": fwd_bwd(torch.compile(eager, dynamic=False)),
        "liger-kernel": fwd_bwd(liger_kernel),
    }


def main() -> None:
    args = parse_args(__doc__)
    wanted = set(filter(None, args.providers.split(",")))
    copy_gbs = copy_bandwidth_gbs()
    cases = [(*HEADLINE, True)] + ([] if args.quick else [(*HEADLINE, False)] + [(*s, True) for s in SWEEP])
    results = []
    for rows, hidden, bias in cases:
        label = f"layer_norm {rows}x{hidden}" + ("" if bias else " no bias")
        results += time_case(label, providers(rows, hidden, bias), 10 * rows * hidden, copy_gbs,
                             {"rows": rows, "hidden": hidden, "bias": bias}, wanted)
    report("layer_norm", args.out, results, copy_gbs, "bf16, eps 1e-5; eager = F.layer_norm on bf16 inputs")


if __name__ == "__main__":
    main()
