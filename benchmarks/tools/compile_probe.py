"""Where a compiled training step's first call spends its time, by model depth (torch.compile, inductor, CUDA).

For each depth a fresh subprocess builds bench_e2e's model at one config's widths cut to that many layers, wraps it in
``torch.compile(fullgraph=True)`` and times the first step (trace, compile, run) and the second (run only), then prints
dynamo's per-phase compile times (``torch._dynamo.utils.compile_times``). How the first step grows with depth tells a
per-layer cost (lowering, kernel compiles) from a fixed one; the phases tell tracing from inductor from Triton's
compiles (``async_compile.wait``). Each depth compiles cold (empty caches of its own). A depth that does not finish
within ``--timeout`` has every thread's stack dumped into its log shortly before it is killed.

    python benchmarks/tools/compile_probe.py --out DIR [--config llama-3.2-1b] [--layers 1,2,4] [--timeout 240]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_e2e
from bench_e2e import CONFIGS  # noqa: E402
from harness import arm_stack_dumps, run_worker  # noqa: E402


# Dynamo's phases worth a column: tracing, forward and backward compiles, lowering, code generation, and the wait for
# the Triton compiles running in the worker pool.
PHASES = ("bytecode_tracing", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler",
          "GraphLowering.run", "Scheduler.codegen", "async_compile.wait", "compile_file")


def _worker(config: str, layers: int, device: str) -> dict:
    import torch

    from liger_models.auto import model_class
    from liger_models.train.optim import FusedAdamW

    cfg, batch, seq = CONFIGS[config]
    cfg = {**cfg, "num_hidden_layers": layers}
    cls = model_class(cfg["model_type"])
    torch.manual_seed(0)
    model = cls.from_config(cls.config_class.from_hf(dict(cfg)), dtype=torch.bfloat16, device=device).train()
    run = torch.compile(model, fullgraph=True)
    opt = FusedAdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg["vocab_size"], (2, batch, seq), device=device)
    times = []
    for i in range(2):
        t0 = time.perf_counter()
        run(input_ids=ids[i], labels=ids[i]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 2))
    import torch._inductor.config as inductor_config

    phases = {}
    for line in torch._dynamo.utils.compile_times().splitlines()[2:]:  # a title, then "Function, Runtimes (s)"
        name, _, values = line.partition(",")
        phases[name.strip()] = round(sum(float(v) for v in values.split(",") if v.strip()), 2)
    return dict(config=config, layers=layers, first_step_s=times[0], second_step_s=times[1],
                compile_threads=inductor_config.compile_threads, phases=phases)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--config", default="llama-3.2-1b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", default="1,2,4")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per depth")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (PyTorch reference ops)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per row instead of the config's (a CPU smoke test)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        arm_stack_dumps()
        if args.seq:
            cfg, batch, _ = CONFIGS[args.worker[0]]
            CONFIGS[args.worker[0]] = (cfg, 1, args.seq)
        print("RESULT " + json.dumps(_worker(args.worker[0], int(args.worker[1]), args.device)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        log = os.path.join(args.out, f"compile_probe_{args.config}_{layers}l.log")
        # Each depth compiles cold, in empty inductor and Triton caches of its own: a deeper model would otherwise
        # find the shallower one's kernels cached (its layers are the same) and hide a per-kernel cost.
        cache = tempfile.mkdtemp(prefix=f"compile_probe_{layers}l_")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        row, timed_out, _ = run_worker([__file__, "--device", args.device, "--seq", str(args.seq), "--worker",
                                        args.config, str(layers)], log, args.timeout, env)
        if row is None:
            row = dict(layers=layers, error="timeout" if timed_out else "failed")
        shutil.rmtree(cache, ignore_errors=True)
        row["log"] = log
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(args.out, f"compile_probe_{args.config}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n| {args.config} layers | first step s | second step s | compile threads | phases (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['layers']} | {r['error']} | | | see {r['log']} |")
            continue
        shown = [(k, r["phases"][k]) for k in PHASES if k in r["phases"]]
        print(f"| {r['layers']} | {r['first_step_s']} | {r['second_step_s']} | {r['compile_threads']} | "
              + ", ".join(f"{k} {v}" for k, v in shown) + " |")


if __name__ == "__main__":
    main()
