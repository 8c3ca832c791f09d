"""SwiGLU forward + backward: this project vs eager PyTorch, torch.compile and liger-kernel 0.8.5 (bf16).

Eager is HF's MLP expression `act(gate) * up` in bf16 (two separate projection outputs, as Llama has);
torch.compile compiles that function. liger-kernel runs LigerSiLUMulFunction on the same separate tensors.
This project is timed on the fused (rows, 2I) gate_up output (swiglu_packed, Phi3 layout) and on separate
gate/up tensors (swiglu). Inputs are autograd intermediates, as in a model, so gradients come from
torch.autograd.grad w.r.t. them. Bytes: forward reads gate and up and writes out, backward reads dout, gate
and up and writes d gate and d up: 8·rows·I·2 B; floor = bytes / measured copy bandwidth.

    python benchmarks/bench_swiglu.py [--quick] [--out DIR] [--providers liger-models,eager,...]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _bandwidth import report, time_case
from harness import copy_bandwidth_gbs, parse_args

SWEEP = [(rows, inter) for rows in (4096, 16384) for inter in (4096, 8192, 14336)]


def _intermediate(shape) -> torch.Tensor:
    """A bf16 tensor produced by autograd (like a projection output), N(0, 2²)."""
    return (2 * torch.randn(shape, device="cuda", dtype=torch.bfloat16)).requires_grad_().clone()


def liger_fn(module: str, name: str):
    def fn(gate, up):
        import importlib

        return getattr(importlib.import_module(module), name).apply(gate, up)

    return fn


def packed_step(rows: int, inter: int, fn_packed, dout: torch.Tensor | None = None):
    """fwd+bwd of this project's packed op on a fresh (rows, 2I) intermediate."""
    gate_up = _intermediate((rows, 2 * inter))
    dout = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16) if dout is None else dout
    return lambda: torch.autograd.grad(fn_packed(gate_up), gate_up, dout)


def gated_providers(rows: int, inter: int, eager_act, ours, ours_packed, liger) -> dict:
    """fwd+bwd closures per provider, each on its own fresh inputs (some backwards overwrite their inputs)."""
    dout = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)

    def eager(gate, up):
        return eager_act(gate) * up

    compiled = torch.compile(eager, dynamic=False)

    def separate(fn):
        gate, up = _intermediate((rows, inter)), _intermediate((rows, inter))
        return lambda: torch.autograd.grad(fn(gate, up), (gate, up), dout)

    providers = {
        "liger-models packed": packed_step(rows, inter, ours_packed, dout),
        "liger-models": separate(ours),
        "eager": separate(eager),
        "torch.compile": separate(compiled),
    }
    if liger is not None:  # None where liger-kernel has no such op (exact-erf GeGLU)
        providers["liger-kernel"] = separate(liger)
    return providers


def bench_gated(name: str, args, cases: list[tuple[str, int, int, dict]]) -> None:
    """cases: (label, rows, I, gated_providers kwargs): time each, then save and print the tables."""
    wanted = set(filter(None, args.providers.split(",")))
    copy_gbs = copy_bandwidth_gbs()
    results = []
    for label, rows, inter, kwargs in cases:
        nbytes = 8 * rows * inter * 2
        results += time_case(label, gated_providers(rows, inter, **kwargs), nbytes, copy_gbs,
                             {"rows": rows, "I": inter}, wanted)
    report(name, args.out, results, copy_gbs, "eager = HF act(gate) * up in bf16; liger-kernel on separate tensors")


def main() -> None:
    from liger_models.kernels.ops.swiglu import swiglu, swiglu_packed

    args = parse_args(__doc__)
    kwargs = dict(eager_act=F.silu, ours=swiglu, ours_packed=swiglu_packed,
                  liger=liger_fn("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"))
    shapes = [(16384, 14336)] + ([] if args.quick else [s for s in SWEEP if s != (16384, 14336)])
    bench_gated("swiglu", args, [(f"{r}x{i}", r, i, kwargs) for r, i in shapes])


if __name__ == "__main__":
    main()
