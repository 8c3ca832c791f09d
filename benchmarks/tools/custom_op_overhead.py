"""Host time that dispatching through a ``torch.library`` custom op with autograd adds to a forward + backward,
against calling an ``autograd.Function`` directly (what the eager paths do; liger_models/kernels/_custom_ops.py).

Both wrap the same body, RMSNorm's PyTorch reference on a tiny CPU tensor, with a backward of the same cost, so the
difference is the dispatch alone (the custom op's Python wrapper, the dispatcher's Autograd and CPU kernels, the
generated Function, setup_context). CPU only; no GPU, no Triton.

    python benchmarks/tools/custom_op_overhead.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import time

import torch

from liger_models.kernels.ops.rms_norm import rms_norm_reference


class _Direct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return rms_norm_reference(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy * w, (dy * x).sum(0)


@torch.library.custom_op("liger_models_bench::rms_norm", mutates_args=())
def _op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm_reference(x, w)


@_op.register_fake
def _(x, w):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, w = ctx.saved_tensors
    return dy * w, (dy * x).sum(0)


_op.register_autograd(_backward, setup_context=_setup)


def _round(fn, x, w, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x, w).sum().backward()
    return (time.perf_counter() - start) / calls * 1e6


def _best_us(fns: dict, x, w, calls: int, rounds: int) -> dict:
    """The best round of each, rounds interleaved: the CPU is shared, and the best is the least disturbed."""
    for fn in fns.values():
        _round(fn, x, w, 100)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], _round(fn, x, w, calls))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(4, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    best = _best_us({"direct": _Direct.apply, "op": _op}, x, w, args.calls, args.rounds)
    print(f"forward + backward, µs per call: Function.apply {best['direct']:.1f}, custom op {best['op']:.1f}, "
          f"added by the op {best['op'] - best['direct']:.1f}")

if __name__ == "__main__":
    main()
