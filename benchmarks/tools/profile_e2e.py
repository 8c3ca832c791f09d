"""Where one training step's time and memory go, per family (torch.profiler on the GPU).

Builds the bench_e2e model for each config (this project's provider), runs warm-up steps, then profiles one step
and groups GPU kernel time by what the kernel does (GEMMs, attention, our Triton kernels by op, optimizer,
elementwise, copies). "host gap" is one unprofiled step's wall time minus the profiled step's summed kernel time; it
includes the step's start-up and clock differences, so the GPU's real idle time is "idle": the profiled step's kernel
intervals merged over all streams, the gaps between them charged to the kernels on either side.
Memory: peak allocated split into weights, gradients (of the trained parameters), optimizer state and the rest
(activations + transients).

With --lora the step is bench_lora.py's (its configs and providers, r 16 on all seven decoder linears, the HF
peers under bf16 autocast): where a LoRA step's time goes, the adapters' products and the dropout kernels included.

    python benchmarks/tools/profile_e2e.py --out DIR [--configs llama-3.2-1b,...] [--provider ours]
    python benchmarks/tools/profile_e2e.py --out DIR --lora --configs llama-3.1-8b --provider ours \
        [--batch 2 --seq 4096 --checkpointing off --dropout 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*
from bench_e2e import CONFIGS, training_step  # noqa: E402

# First match wins: a kernel name containing any of the needles belongs to the category.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn")),
    ("loss (CE kernel)", ("_ce_kernel", "_scale_kernel", "cross_entropy", "log_softmax", "nll_loss")),
    ("norm", ("_norm_", "_sum_partials", "rms", "layer_norm")),
    ("rope", ("_rope",)),
    ("dropout", ("_dropped_matmul", "dropout")),  # ours: the LoRA products that draw the mask; torch's dropout
    ("NF4 dequantisation", ("nf4", "kdequantize")),  # ours (dequantise, nf4_matmul), bitsandbytes' kDequantize*
    ("gated act", ("_gated", "silu", "gelu", "swiglu", "geglu")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "wgmma")),
    ("embedding", ("embedding", "index_select", "indexselect", "scatter", "gather", "index_put")),
    ("copy / fill", ("copy", "memcpy", "memset", "fill", "cat", "zero")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, needles in CATEGORIES:
        if any(n in low for n in needles):
            return cat
    return "other"


def _training(name: str, provider: str, n_batches: int, lora: tuple | None):
    """(model, optimizer, token batches, step, forward context): bench_e2e's step, or bench_lora's with ``lora`` =
    (batch, seq, checkpointing)."""
    if lora is None:
        from contextlib import nullcontext

        return (*training_step(name, provider, n_batches), nullcontext)
    from bench_lora import lora_training_step

    return lora_training_step(name, provider, n_batches, *lora)


def _worker(name: str, provider: str, warmup: int, lora: tuple | None = None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, opt, ids, step, context = _training(name, provider, warmup + 2, lora)
    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step(warmup)
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated()
    # Which phase sets the peak: forward (activations + the loss's in-forward gradients), backward, optimizer.
    phases = {}
    torch.cuda.reset_peak_memory_stats()
    with context():
        loss = model(input_ids=ids[warmup], labels=ids[warmup]).loss
    torch.cuda.synchronize()
    phases["forward_peak"], phases["forward_end"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    del loss
    torch.cuda.synchronize()
    phases["backward_peak"], phases["backward_end"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    phases["optimizer_peak"] = torch.cuda.max_memory_allocated()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(warmup + 1)
        torch.cuda.synchronize()

    kernels = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += ev.device_time_total / 1e3
            k[1] += 1
    busy = sum(v[0] for v in kernels.values())
    cats = defaultdict(float)
    for kname, (ms, _) in kernels.items():
        cats[category(kname)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    states = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    gib = 2**30
    return dict(config=name, provider=provider, step_ms=plain_ms, gpu_busy_ms=busy,
                host_gap_ms=max(plain_ms - busy, 0.0),
                categories=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                top_kernels=[dict(name=n[:120], ms=v[0], calls=v[1], category=category(n)) for n, v in top],
                idle=idle_between_kernels(prof),
                memory_gib=dict(peak=peak / gib, weights=weights / gib, grads=grads / gib,
                                optimizer=states / gib, rest=(peak - weights - grads - states) / gib,
                                **{k: v / gib for k, v in phases.items()}))


def idle_between_kernels(prof) -> dict:
    """Where the GPU sits idle inside the profiled step: kernel intervals of every stream merged, each idle gap
    between them charged to the categories of the kernels on either side, plus a size histogram. Gaps of a few µs
    between dependent kernels are launch latency; long ones point at a wait (a host sync, a side stream, Python)."""
    import torch

    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start)
    if not spans:
        return {}
    by_pair, buckets = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    busy, (start, end, last) = 0.0, spans[0]
    for s, e, name in spans[1:]:
        if s > end:
            gap = s - end
            pair = by_pair[f"{category(last)} -> {category(name)}"]
            pair[0] += gap / 1e3
            pair[1] += 1
            buckets["<5us" if gap < 5 else "5-20us" if gap < 20 else "20-100us" if gap < 100 else ">=100us"] += gap / 1e3
            busy += end - start
            start = s
        if e >= end:
            end, last = e, name
    busy += end - start
    span_ms = (spans[-1][1] - spans[0][0]) / 1e3
    top = sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:12]
    return dict(span_ms=span_ms, union_busy_ms=busy / 1e3, idle_ms=span_ms - busy / 1e3, idle_buckets=dict(buckets),
                idle_by_pair=[dict(pair=k, ms=v[0], gaps=v[1]) for k, v in top])


def report(r: dict) -> str:
    lines = [f"### {r['config']} ({r['provider']}): step {r['step_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms, "
             f"host gap {r['host_gap_ms']:.1f} ms"]
    lines.append("| category | ms | % of step |")
    lines.append("|---|---|---|")
    for cat, ms in r["categories"].items():
        lines.append(f"| {cat} | {ms:.1f} | {100 * ms / r['step_ms']:.1f}% |")
    m = r["memory_gib"]
    lines.append(f"memory GiB: peak {m['peak']:.1f} = weights {m['weights']:.1f} + grads {m['grads']:.1f} + "
                 f"optimizer {m['optimizer']:.1f} + activations/transients {m['rest']:.1f}; by phase: forward peak "
                 f"{m['forward_peak']:.1f} (end {m['forward_end']:.1f}), backward peak {m['backward_peak']:.1f}, "
                 f"optimizer peak {m['optimizer_peak']:.1f}")
    idle = r.get("idle") or {}
    if idle:
        lines.append(f"profiled step: first kernel to last {idle['span_ms']:.1f} ms, kernels running "
                     f"{idle['union_busy_ms']:.1f} ms, idle {idle['idle_ms']:.1f} ms (by gap size: "
                     + ", ".join(f"{k} {v:.1f}" for k, v in idle["idle_buckets"].items()) + "); idle between: "
                     + "; ".join(f"{p['pair']} {p['ms']:.1f} ms/{p['gaps']}" for p in idle["idle_by_pair"][:8]))
    lines.append("top kernels: " + "; ".join(f"{k['name'][:60]} {k['ms']:.1f}ms×{k['calls']}" for k in r["top_kernels"][:12]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--configs")
    ap.add_argument("--provider", default="ours")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora", action="store_true", help="bench_lora.py's step (configs and providers) instead")
    ap.add_argument("--batch", type=int, default=2, help="--lora: sequences a step (default 2)")
    ap.add_argument("--seq", type=int, default=4096, help="--lora: tokens a sequence (default 4096)")
    ap.add_argument("--checkpointing", choices=("on", "off"), default="off", help="--lora: per-layer checkpoints")
    ap.add_argument("--dropout", type=float, default=0.0, help="--lora: every provider's lora_dropout")
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "PROVIDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    lora = (args.batch, args.seq, args.checkpointing == "on") if args.lora else None
    if args.worker:
        print("RESULT " + json.dumps(_worker(*args.worker, args.warmup, lora)), flush=True)
        return
    if args.lora:
        from bench_lora import CONFIGS as LORA_CONFIGS

        os.environ["LIGER_BENCH_LORA_DROPOUT"] = str(args.dropout)  # what bench_lora's builders read
    configs = args.configs or ",".join(LORA_CONFIGS if args.lora else CONFIGS)
    shape = ["--lora", "--batch", str(args.batch), "--seq", str(args.seq), "--checkpointing", args.checkpointing] \
        if args.lora else []
    rows = []
    for name in configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--worker", name, args.provider, "--warmup", str(args.warmup),
                               *shape], capture_output=True, text=True, timeout=600 if args.lora else 300)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if not line:
            print(f"{name}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        rows.append(json.loads(line[7:]))
        if args.lora:
            rows[-1].update(batch=args.batch, seq=args.seq, checkpointing=args.checkpointing == "on",
                            dropout=args.dropout)
        print(report(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    kind = f"lora_{args.checkpointing}_ckpt_" if args.lora else ""
    with open(os.path.join(args.out, f"profile_e2e_{kind}{args.provider}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
