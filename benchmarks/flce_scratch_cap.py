"""Linear-CE at the end-to-end steps' loss shapes under a cap on its logits scratch (issue 6, memory).

Gemma-2B misses its memory target by 0.19 GiB and its step peaks inside linear-CE's forward, where the fp32 V×H dW
accumulator and grad_W (serving as the logits scratch) are both alive: 6·V·H bytes. Under a cap below grad_W's
rows the accumulator becomes grad_W in place and the op's peak is 4·V·H + the cap (fused_linear_cross_entropy.
MAX_SCRATCH_BYTES). The ninth session measured that at 1024 rows as 124 instead of 84 ms per Gemma step, far more
than the extra accumulator traffic predicts (about 4 GiB more per extra chunk). This times the op (forward +
backward, hidden and weight gradients, as a tied LM head trains) at each cap, with the peak memory above the inputs
and a torch.profiler breakdown of its GPU time by kernel, so the cause can be named.

    python benchmarks/flce_scratch_cap.py [--out DIR]
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict

import torch
from harness import parse_args

SHAPES = {"gemma-2b": (16384, 2048, 256000), "llama-3.2-1b": (16384, 2048, 128256)}
CAP_ROWS = (None, 1792, 1536, 1280, 1024)


def op(n: int, hdim: int, vocab: int, cap_rows: int | None):
    from liger_models.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy

    hidden = (torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, hdim, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    cap = None if cap_rows is None else cap_rows * vocab * 2

    def run():
        hidden.grad = weight.grad = None
        fused_linear_cross_entropy(hidden, weight, labels, max_scratch_bytes=cap).backward()

    return run, (hidden, weight, labels)


def timed_ms(fn, reps: int = 6) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_gib(fn, tensors) -> float:
    """Peak above the inputs alone: the gradient outputs count, as in the step."""
    fn()
    tensors[0].grad = tensors[1].grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def kernel_breakdown(fn, top: int = 8) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = total[event.name[:90]]
            entry[0] += event.device_time_total / 1000
            entry[1] += 1
    rows = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"kernel": name, "ms": round(ms, 3), "calls": calls} for name, (ms, calls) in rows]


def main() -> None:
    args = parse_args(__doc__)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for config, (n, hdim, vocab) in SHAPES.items():
        for cap_rows in CAP_ROWS:
            run, keep = op(n, hdim, vocab, cap_rows)
            row = {"config": config, "shape": [n, hdim, vocab], "cap_rows": cap_rows,
                   "ms": round(timed_ms(run), 3), "peak_extra_gib": round(peak_gib(run, keep), 3),
                   "kernels": kernel_breakdown(run)}
            results.append(row)
            print(f"{config} cap {cap_rows}: {row['ms']:.2f} ms, +{row['peak_extra_gib']:.3f} GiB", flush=True)
            for k in row["kernels"]:
                print(f"    {k['ms']:8.2f} ms {k['calls']:4d}x {k['kernel']}")
            del run, keep
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "flce_scratch_cap.json"), "w") as f:
        json.dump({"results": results, "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
