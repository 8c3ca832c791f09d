"""Decoding on an NF4 base (a bitsandbytes 4-bit checkpoint, or a QLoRA base being evaluated): the product of a few
rows with NF4 weights, and batch-1 greedy decoding of a whole model.

Products (bf16, the median of do_bench with L2 flushed, as every kernel benchmark here), rows M (--rows, default 1, 4,
16) times the Llama-3.1-8B linears:
  liger-models     kernels/ops/nf4_matmul.py: the codes decoded inside the K-loop
  dequant+mm       this project's dequantisation kernel, then torch.mm (what decoding ran before nf4_matmul)
  bf16             torch.mm on the bf16 weight (what a bf16 model pays)
  bitsandbytes     bitsandbytes.matmul_4bit from its own 4-bit state (its GEMV kernel at M = 1)
  floor            the codes and fp32 block scales (0.5625 byte a weight) at the copy rate measured in the same run

Decoding (Llama-3.1-8B shapes, 32 layers, random init, --batch prompts (default 1) of 128 tokens, greedy, ms per
decoding step from the difference between NEW_TOKENS and SHORT_TOKENS budgets, the median of REPS runs; a step makes
one token per prompt): ours bf16, ours on the NF4 base with nf4_matmul on up to its 16 rows and off (``max_rows=0``:
dequantise, stack, GEMM), all replayed as CUDA graphs; HF transformers' generate with bitsandbytes Linear4bit layers
(eager, its default cache) on the same NF4-quantised weights. A batch of 2-16 prompts is what decides how many rows
``nf4_matmul.max_rows`` should send to the kernel.

    python benchmarks/bench_nf4_decode.py --out DIR [--parts products,decode] [--rows 1,2,4] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from bench_lora import CONFIGS, _bnb_linears  # noqa: E402

SHAPES = {"8b-q|o": (4096, 4096), "8b-k|v": (1024, 4096), "8b-gate|up": (14336, 4096), "8b-down": (4096, 14336)}
ROWS = (1, 4, 16)
PROMPT, SHORT_TOKENS, NEW_TOKENS, REPS = 128, 16, 80, 3


def products(torch, rows: tuple[int, ...] = ROWS) -> tuple[list, dict]:
    from liger_models.kernels.ops import nf4, nf4_matmul as nm

    try:
        import bitsandbytes as bnb
    except Exception:  # noqa: BLE001 - a missing peer is reported as missing
        bnb = None
    gbs = harness.copy_bandwidth_gbs()
    results, floors = [], {}
    for name, shape in SHAPES.items():
        w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
        codes, absmax = nf4.quantize_nf4(w)
        state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True) if bnb else None
        for m in rows:
            x = torch.randn(m, shape[1], device="cuda", dtype=torch.bfloat16)
            providers = {
                "liger-models": lambda: nm.nf4_matmul(x, codes, absmax, shape),  # called directly: on at any max_rows
                "dequant+mm": lambda: x @ nf4.dequantize_nf4(codes, absmax, shape, torch.bfloat16).t(),
                "bf16": lambda: x @ w.t(),
            }
            if state is not None:
                q, qs = state
                providers["bitsandbytes"] = lambda: bnb.matmul_4bit(x, q.t(), quant_state=qs)
            case = f"{name} M={m}"
            floors[case] = w.numel() * (0.5 + 4 / 64) / (gbs * 1e9) * 1e3
            results += harness.run_case(case, providers, {"shape": list(shape), "rows": m})
            ref = x.float() @ nf4.dequantize_nf4_reference(codes, absmax, shape, torch.bfloat16).float().t()
            results[-len(providers)].extra["max_rel_err"] = float(
                ((nm.nf4_matmul(x, codes, absmax, shape).float() - ref).abs().max() / ref.abs().max()).item())
    return results, {"copy_gbs": gbs, "floors_ms": floors}


def _ms_per_token(run) -> float:
    import torch

    def wall(k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(k)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    run(SHORT_TOKENS)  # compile, capture
    short = statistics.median(wall(SHORT_TOKENS) for _ in range(REPS))
    long = statistics.median(wall(NEW_TOKENS) for _ in range(REPS))
    return (long - short) / (NEW_TOKENS - SHORT_TOKENS)


def decode(torch, with_hf: bool = True, batch: int = 1) -> list[dict]:
    import transformers

    from liger_models.auto import model_class
    from liger_models.kernels import _tuning
    from liger_models.kernels.ops import nf4_matmul as nm
    from liger_models.lora import quantize_base_

    cfg = dict(CONFIGS["llama-3.1-8b"])
    cls = model_class(cfg["model_type"])
    torch.manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (batch, PROMPT), device="cuda")
    rows = []

    def ours(name, model):
        def run(k):
            return model.generate(ids, max_new_tokens=k, eos_token_id=[], cuda_graph=True)
        ms = _ms_per_token(run)
        rows.append(dict(provider=name, batch=batch, ms_per_token=ms, tokens_per_s=batch * 1e3 / ms,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
        print(rows[-1], flush=True)

    model = cls.from_config(cls.config_class.from_hf(dict(cfg)), dtype=torch.bfloat16, device="cuda").eval()
    ours("ours bf16", model)
    quantize_base_(model)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with _tuning.tuned(nm, max_rows=nm.ROWS):
        ours("ours NF4, nf4_matmul", model)
    with _tuning.tuned(nm, max_rows=0):
        ours("ours NF4, dequantise + GEMM", model)
    del model
    torch.cuda.empty_cache()
    if not with_hf:
        return rows
    try:
        config = transformers.AutoConfig.for_model(**cfg)
        with torch.device("cuda"):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        _bnb_linears(hf, torch, "cuda")
        hf.eval()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

        def run(k):
            with torch.no_grad():
                return hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        ms = _ms_per_token(run)
        rows.append(dict(provider="HF + bitsandbytes 4-bit", batch=batch, ms_per_token=ms, tokens_per_s=batch * 1e3 / ms,
                         peak_gib=torch.cuda.max_memory_allocated() / 2**30))
    except Exception as e:  # noqa: BLE001 - a failing peer is recorded, not raised
        rows.append(dict(provider="HF + bitsandbytes 4-bit", error=f"{type(e).__name__}: {e}"[:300]))
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--parts", default="products,decode")
    p.add_argument("--no-hf", action="store_true", help="decode: leave out HF + bitsandbytes (its build and ~45 s)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="products: x's row counts (default 1,4,16)")
    p.add_argument("--batch", type=int, default=1, help="decode: prompts decoded together (default 1)")
    args = p.parse_args()
    import torch

    os.makedirs(args.out, exist_ok=True)
    tunables = harness.apply_tunables()  # LIGER_TUNE=nf4_matmul.tile=8192,... for a variant
    parts = set(args.parts.split(","))
    if "products" in parts:
        results, meta = products(torch, tuple(int(m) for m in args.rows.split(",")))
        harness.save("bench_nf4_matmul", args.out, results, {**meta, "tuning": tunables})
        print(harness.table(results, meta["floors_ms"]), flush=True)
    if "decode" in parts:
        rows = decode(torch, with_hf=not args.no_hf, batch=args.batch)
        with open(os.path.join(args.out, "nf4_decode.json" if args.batch == 1 else f"nf4_decode_batch_{args.batch}.json"),
                  "w") as f:
            json.dump(dict(environment=harness.environment(), rows=rows), f, indent=1)
        for r in rows:
            print(f"| {r['provider']} | " + (f"{r['ms_per_token']:.2f} ms/step, {r['tokens_per_s']:.1f} tok/s, "
                                              f"{r['peak_gib']:.1f} GiB |" if "error" not in r else r["error"]))


if __name__ == "__main__":
    main()
