"""Where a batch-1 decoding step's time goes: host (cProfile) and GPU (torch.profiler), ours and HF's generate.

Decoding one token at a time is host-bound at these sizes: the GPU needs ~0.5 ms for Llama-3.2-1B's weights, while
the host issues a few hundred ops per token. This prints, per generated token, the host time, the GPU busy time,
the number of GPU kernels and the top host functions, so the slow part of the step can be named.

    python benchmarks/profile_decode.py --out DIR [--config llama-3.2-1b] [--tokens 32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_medusa_decoding import CONFIGS, _hf_model  # noqa: E402


def _gpu_summary(prof, tokens: int) -> dict:
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_us = sum(e.device_time_total for e in events if e.device_time_total)
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.device_time_total)
    top = sorted(((sum(v), len(v), k) for k, v in by_name.items()), reverse=True)[:15]
    return {"kernels_per_token": len(events) / tokens, "gpu_busy_ms_per_token": busy_us / 1e3 / tokens,
            "top_kernels": [dict(name=k[:90], us_per_token=t / tokens, calls_per_token=n / tokens)
                            for t, n, k in top]}


def profile(name: str, generate, tokens: int, out: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    generate(tokens)  # warm-up: compiles, allocator
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(tokens)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    first = time.perf_counter()
    generate(1)
    torch.cuda.synchronize()
    prefill = (time.perf_counter() - first) * 1e3
    pr = cProfile.Profile()
    pr.enable()
    generate(tokens)
    torch.cuda.synchronize()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
    with open(os.path.join(out, f"profile_decode_{name}.txt"), "w") as f:
        f.write(text.getvalue())
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(tokens)
        torch.cuda.synchronize()
    summary = {"name": name, "ms_per_token": (wall - prefill) / (tokens - 1), **_gpu_summary(prof, tokens)}
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    with open(os.path.join(out, f"profile_decode_{name}.txt"), "a") as f:
        f.write("\n\n" + ops)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--config", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    import torch

    from liger_models.llama.config import LlamaConfig
    from liger_models.llama.modeling import LigerLlamaForCausalLM

    os.makedirs(args.out, exist_ok=True)
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    model = LigerLlamaForCausalLM.from_config(LlamaConfig.from_hf(dict(cfg)), dtype=torch.bfloat16, device="cuda").eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, 128), device="cuda")
    rows = []
    with torch.no_grad():
        rows.append(profile("ours", lambda n: model.generate(ids, max_new_tokens=n, eos_token_id=[]), args.tokens,
                            args.out))
        if not args.no_hf:
            hf = _hf_model(cfg, model.state_dict())
            kw = dict(do_sample=False)
            rows.append(profile("hf", lambda n: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw),
                                args.tokens, args.out))
    with open(os.path.join(args.out, "profile_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['name']}: {r['ms_per_token']:.2f} ms/token, GPU busy {r['gpu_busy_ms_per_token']:.2f} ms/token, "
              f"{r['kernels_per_token']:.0f} kernels/token")
        for k in r["top_kernels"][:8]:
            print(f"   {k['us_per_token']:8.1f} us/token {k['calls_per_token']:6.1f}x  {k['name']}")
    print(open(os.path.join(args.out, "profile_decode_ours.txt")).read()[:6000])


if __name__ == "__main__":
    main()
