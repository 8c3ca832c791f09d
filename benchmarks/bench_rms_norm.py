"""RMSNorm and fused residual-add + RMSNorm, forward + backward: this project vs eager PyTorch (HF LlamaRMSNorm
numerics, the reference), torch.compile of that reference and liger-kernel 0.8.5 (bf16, llama casting).

Inputs are autograd intermediates (as in a model) plus a bf16 weight; every provider returns (dx, dw) through
torch.autograd.grad. Bytes (the floor): rms_norm reads x, writes y, then reads dy and x and writes dx:
10·rows·H B; add_rms_norm reads x and residual and writes y and r, then reads dy, dr and r and writes dx:
16·rows·H B (weights, rstd and dW partials are < 1% and not counted). floor = bytes / copy bandwidth.

    python benchmarks/bench_rms_norm.py [--quick] [--out DIR] [--providers liger-models,eager,...]
"""

from __future__ import annotations

import torch
from _bandwidth import report, time_case
from harness import copy_bandwidth_gbs, parse_args

HEADLINE = (16384, 4096)
SWEEP = [(rows, hidden) for rows in (4096, 16384) for hidden in (1024, 2048, 4096, 8192, 16384)]
EPS = 1e-6


def _intermediate(rows: int, hidden: int) -> torch.Tensor:
    return torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_().clone()


def _weight(hidden: int) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16().requires_grad_()


def _liger(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


def norm_providers(rows: int, hidden: int) -> dict:
    from liger_models.kernels.ops.rms_norm import rms_norm, rms_norm_reference

    torch._dynamo.reset()  # a fresh compile per case: past 8 shapes Dynamo would silently run eager
    x, w, dy = _intermediate(rows, hidden), _weight(hidden), torch.randn(rows, hidden, device="cuda",
                                                                          dtype=torch.bfloat16)

    def reference(x_, w_):
        return rms_norm_reference(x_, w_, EPS)

    def liger_kernel(x_, w_):  # LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place)
        return _liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction").apply(x_, w_, EPS, 0.0, "llama", False)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(x, w), (x, w), dy)

    return {
        "liger-models": fwd_bwd(lambda x_, w_: rms_norm(x_, w_, EPS)),
        "eager": fwd_bwd(reference),
        "torch.compile": fwd_bwd(torch.compile(reference, dynamic=False)),
        "liger-kernel": fwd_bwd(liger_kernel),
    }


def add_norm_providers(rows: int, hidden: int) -> dict:
    from liger_models.kernels.ops.rms_norm import add_rms_norm, rms_norm_reference

    torch._dynamo.reset()  # a fresh compile per case: past 8 shapes Dynamo would silently run eager
    x, res, w = _intermediate(rows, hidden), _intermediate(rows, hidden), _weight(hidden)
    dy, dr = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def reference(x_, res_, w_):  # HF decoder layer: h = h + a; normed = norm(h)
        r = x_ + res_
        return rms_norm_reference(r, w_, EPS), r

    def liger_kernel(x_, res_, w_):  # LigerFusedAddRMSNormFunction.apply(X, R, W, eps, offset, casting, in_place)
        fn = _liger("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
        return fn.apply(x_, res_, w_, EPS, 0.0, "llama", False)

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(x, res, w), (x, res, w), (dy, dr))

    return {
        "liger-models": fwd_bwd(lambda x_, res_, w_: add_rms_norm(x_, res_, w_, EPS)),
        "eager": fwd_bwd(reference),
        "torch.compile": fwd_bwd(torch.compile(reference, dynamic=False)),
        "liger-kernel": fwd_bwd(liger_kernel),
    }


def main() -> None:
    args = parse_args(__doc__)
    wanted = set(filter(None, args.providers.split(",")))
    copy_gbs = copy_bandwidth_gbs()
    # Headline cases first (a run cut short still has them), then the sweep.
    cases = [("rms_norm", HEADLINE), ("add_rms_norm", HEADLINE)]
    if not args.quick:
        cases += [("rms_norm", s) for s in SWEEP if s != HEADLINE] + [("add_rms_norm", (4096, 8192))]
    results = []
    for op, (rows, hidden) in cases:
        add = op == "add_rms_norm"
        results += time_case(f"{op} {rows}x{hidden}", (add_norm_providers if add else norm_providers)(rows, hidden),
                             (16 if add else 10) * rows * hidden, copy_gbs, {"rows": rows, "hidden": hidden, "op": op},
                             wanted)
    report("rms_norm", args.out, results, copy_gbs,
           "bf16, llama casting, eps 1e-6; eager = HF LlamaRMSNorm expression; add_rms_norm eager = h + a then norm")


if __name__ == "__main__":
    main()
