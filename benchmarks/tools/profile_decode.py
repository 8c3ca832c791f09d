"""Where a batch-1 decoding step's time goes: host (cProfile) and GPU (torch.profiler), ours and HF's generate.

Decoding one token at a time is host-bound at these sizes: the GPU needs ~0.5 ms for Llama-3.2-1B's weights, while
the host issues a few hundred ops per token. This prints, per generated token, the host time, the GPU busy time,
the number of GPU kernels and the top host functions, so the slow part of the step can be named.

Per token means the difference between two budgets (SHORT and --tokens), so the prefill and a graphed call's setup
drop out; graphed Medusa steps with random heads emit one token each, so for them it is per step.

    python benchmarks/tools/profile_decode.py --out DIR [--config llama-3.2-1b] [--prompt 128] [--tokens 40]
        [--providers ours,graphed,graphed-stop,medusa-copy,medusa-copy-sync,medusa-shared,medusa-shared-sync,hf]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*

from bench_medusa_decoding import CONFIGS, NUM_HEADS, _hf_model  # noqa: E402

SHORT = 8
REPS = 5  # wall-clock differences, median


def _kernel_totals(prof) -> tuple[float, int, dict[str, list[float]]]:
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.device_time_total or 0.0)
    return sum(sum(v) for v in by_name.values()), len(events), by_name


def _wall_ms(generate, tokens: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(tokens)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def profile(name: str, generate, tokens: int, out: str) -> dict:
    """Per new token (per step for Medusa with random heads: one token a step): wall and GPU time, kernels.
    Each is the difference between budgets `tokens` and SHORT, so the prefill and a graphed call's one-off setup
    (warm-up step, capture) drop out."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    generate(tokens)  # warm-up: compiles, allocator
    extra = tokens - SHORT
    wall = statistics.median(_wall_ms(generate, tokens) - _wall_ms(generate, SHORT) for _ in range(REPS))
    pr = cProfile.Profile()
    pr.enable()
    generate(tokens)
    torch.cuda.synchronize()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
    totals = []
    for n in (SHORT, tokens):
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(n)
            torch.cuda.synchronize()
        totals.append(_kernel_totals(prof))
    (busy0, count0, names0), (busy1, count1, names1) = totals
    per_name = {k: (sum(v) - sum(names0.get(k, [])), len(v) - len(names0.get(k, []))) for k, v in names1.items()}
    top = sorted(((t, c, k) for k, (t, c) in per_name.items()), reverse=True)[:15]
    with open(os.path.join(out, f"profile_decode_{name}.txt"), "w") as f:
        f.write(text.getvalue() + "\n\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return {"name": name, "ms_per_token": wall / extra, "kernels_per_token": (count1 - count0) / extra,
            "gpu_busy_ms_per_token": (busy1 - busy0) / 1e3 / extra,
            "top_kernels": [dict(name=k[:90], us_per_token=t / extra, calls_per_token=c / extra) for t, c, k in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--config", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--providers", default="ours,hf",
                    help="any of ours (eager), graphed (cuda_graph), graphed-stop (cuda_graph with a stop id that "
                         "random weights do not emit: finished rows watched), medusa-copy / medusa-shared (graphed "
                         "greedy Medusa steps, random heads: one token a step; with -sync: each step read before the "
                         "next is launched), hf")
    args = ap.parse_args()
    import torch

    from liger_models.llama.config import LlamaConfig
    from liger_models.llama.modeling import LigerLlamaForCausalLM
    from liger_models.medusa import MedusaModel, decoding

    os.makedirs(args.out, exist_ok=True)
    cfg = CONFIGS[args.config]
    torch.manual_seed(0)
    config = LlamaConfig.from_hf(dict(cfg))
    model = LigerLlamaForCausalLM.from_config(config, dtype=torch.bfloat16, device="cuda").eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, args.prompt), device="cuda")
    rows = []
    with torch.no_grad():
        for provider in args.providers.split(","):
            if provider in ("ours", "graphed", "graphed-stop"):
                graph, stop = provider != "ours", [cfg["vocab_size"] - 1] if provider == "graphed-stop" else []
                run = lambda n, g=graph, e=stop: model.generate(ids, max_new_tokens=n, eos_token_id=e,  # noqa
                                                                 cuda_graph=g)
            elif provider.startswith("medusa-"):
                shared = provider.startswith("medusa-shared")
                medusa = MedusaModel.from_base(model, num_heads=NUM_HEADS, share_lm_head=shared)
                medusa.heads.to(device="cuda", dtype=torch.bfloat16)
                decoding.LAUNCH_AHEAD = not provider.endswith("-sync")
                run = lambda n, m=medusa: m.generate(ids, max_new_tokens=n, eos_token_id=[], cuda_graph=True)  # noqa
            else:
                hf = _hf_model(cfg, model.state_dict())
                run = lambda n, h=hf: h.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # noqa
            rows.append(profile(provider, run, args.tokens, args.out))
            run = medusa = hf = None  # noqa: F841 - frees the heads / the HF copy before the next provider
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, f"profile_decode_{args.config}_{args.prompt}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{args.config} prompt {args.prompt} {r['name']}: {r['ms_per_token']:.2f} ms/token, GPU busy "
              f"{r['gpu_busy_ms_per_token']:.2f} ms/token, {r['kernels_per_token']:.0f} kernels/token")
        for k in r["top_kernels"][:10]:
            print(f"   {k['us_per_token']:8.1f} us/token {k['calls_per_token']:6.1f}x  {k['name']}")


if __name__ == "__main__":
    main()
