"""What the GPU runs during one benchmark step, in order: every kernel, memcpy and memset with its start, its
duration and the idle gap before it (torch.profiler's CUDA activity trace, read back from its Chrome trace).

A step's time in the kernel benchmarks (do_bench: L2 flushed, then the step between two events) is the sum of these
durations and gaps; the gap before the first item is the host's lead over the flush. This separates what a call adds
around its main kernel (small launches, copies, idle stream time) from the kernel itself.

    python benchmarks/tools/gpu_timeline.py [--out DIR] [--steps ce-256k,ce-128k,rope,rms-norm]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*

FLUSH_BYTES = 256 << 20  # as triton.testing.do_bench


def _ce_step(n: int, vocab: int):
    from liger_models.kernels.ops.cross_entropy import cross_entropy

    logits = (2 * torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[::16] = -100
    return lambda: torch.autograd.grad(cross_entropy(logits, labels, inplace_grad=True), logits)


def _rope_step():
    from bench_rope import HEADLINE, ours_step

    return ours_step(*HEADLINE)


def _rms_norm_step():
    from liger_models.kernels.ops.rms_norm import rms_norm

    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    return lambda: torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)


STEPS = {
    "ce-256k": lambda: _ce_step(4096, 256000),
    "ce-128k": lambda: _ce_step(8192, 128256),
    "rope": _rope_step,
    "rms-norm": _rms_norm_step,
}


def timeline(step, reps: int = 5) -> list[list[dict]]:
    """GPU activities of the last `reps` of 3 + reps do_bench-style iterations, one list per iteration."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(3):
        flush.zero_()
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    items = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"
                    and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    # An iteration starts at each flush: the zero_ of FLUSH_BYTES, a fill kernel of ~80 µs (a step's own fills, such
    # as autograd's ones, take ~1 µs).
    starts = [i for i, e in enumerate(items) if "fill" in e["name"].lower() and e["dur"] > 20]
    out = []
    for a, b in zip(starts, starts[1:] + [len(items)]):
        end_prev = items[a]["ts"] + items[a]["dur"]
        rows = []
        for e in items[a + 1 : b]:
            rows.append(dict(name=e["name"][:90], cat=e["cat"], start_us=round(e["ts"] - end_prev, 2),
                             dur_us=round(e["dur"], 2)))
            end_prev = e["ts"] + e["dur"]
        out.append(rows)
    return out


def _print(name: str, iterations: list[list[dict]]) -> None:
    print(f"\n## {name}: {len(iterations)} iterations; the median one by total time")
    totals = [sum(r["start_us"] + r["dur_us"] for r in it) for it in iterations]
    median = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    print(f"| gap before µs | duration µs | kind | name |   (total {totals[median]:.1f} µs; all: "
          + ", ".join(f"{t:.1f}" for t in totals) + ")")
    for r in iterations[median]:
        print(f"| {r['start_us']:.1f} | {r['dur_us']:.1f} | {r['cat']} | {r['name']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--steps", default=",".join(STEPS))
    args = ap.parse_args()
    results = {}
    for name in args.steps.split(","):
        try:
            results[name] = timeline(STEPS[name]())
            _print(name, results[name])
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            print(f"{name}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_timeline.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
