"""End-to-end training step: tokens/s and peak memory for this project vs HF transformers (eager, torch.compile)
and HF + liger-kernel, at the issue-6 shapes (HF config.json shapes, random init, bf16 weights, fused AdamW,
SDPA attention, random tokens, no activation checkpointing; tokens/s over 8 steps after 4 warm-up steps, or over
fewer within --budget seconds for a provider whose steps take longer).

Each (config, provider) runs in its own subprocess so that an OOM, a compile cache or liger-kernel's monkey-patch
never leaks into another measurement.

    python benchmarks/bench_e2e.py --out DIR [--configs llama-1b,qwen-1.5b] [--providers ours,hf,hf_compile,hf_liger]
    python benchmarks/bench_e2e.py --plot OUT.png RESULTS.json|RESULTS.jsonl ...   # bar chart of saved rows
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONFIGS: dict[str, tuple[dict, int, int]] = {
    # name: (HF config.json fields, batch, seq)
    "llama-3.2-1b": (dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                          tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
                          rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)), 8, 2048),
    "qwen2.5-1.5b": (dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768), 8, 2048),
    "gemma-2b": (dict(model_type="gemma", hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000,
                      hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6,
                      max_position_embeddings=8192), 8, 2048),
    "llama-3-8b-w8l": (dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                            tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0,
                            max_position_embeddings=8192), 4, 2048),
    "mistral-7b-w4l": (dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                            tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                            max_position_embeddings=32768), 4, 4096),
    "phi3-mini-w8l": (dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
                           num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                           tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=None,
                           max_position_embeddings=4096), 8, 2048),
    # Gemma 2 9B width, 8 layers (4 sliding, 4 full, W 4096 ≥ seq: the windows never bind at 2048): attention
    # soft-cap 50 (ours: flex_attention's score_mod; HF 5.25: eager, its default, as it refuses SDPA for Gemma 2)
    # and final soft-cap 30 (ours: inside the linear-CE kernel).
    "gemma2-9b-w8l": (dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                           hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6,
                           query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                           sliding_window=4096, rope_theta=10000.0, max_position_embeddings=8192), 4, 2048),
    # Gemma 3 4B's text tower, 8 layers (layer 5 full, the rest sliding over W 1024 < seq), q/k norms, two RoPE
    # tables (global linear ×8), no soft-caps.
    "gemma3-4b-w8l": (dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208,
                           hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, rms_norm_eps=1e-6,
                           query_pre_attn_scalar=256, sliding_window=1024, rope_theta=1000000.0,
                           rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
                           max_position_embeddings=131072), 8, 2048),
    # Issue 36: Qwen3-8B width (q/k norm, head_dim 128) and the MoE widths with a few layers (random init).
    "qwen3-8b-w8l": (dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=8,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          max_position_embeddings=40960), 4, 2048),
    "qwen3-30b-a3b-w4l": (dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                               tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
                               router_aux_loss_coef=0.001, max_position_embeddings=40960), 4, 2048),
    "mixtral-8x7b-w2l": (dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                              num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                              num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False, rms_norm_eps=1e-5,
                              rope_theta=1000000.0, sliding_window=None, router_aux_loss_coef=0.02,
                              max_position_embeddings=32768), 4, 2048),
}
# Attention implementation of the HF providers: SDPA, except where HF refuses it (5.25's Gemma 2: SDPA cannot
# soft-cap the scores); that family runs HF's default, eager.
HF_ATTENTION = {"gemma2": "eager"}
# ours_inbwd: ours with the optimizer step inside backward (liger_models/train/step_in_backward.py): the same
# AdamW updates bit for bit, each gradient freed once its parameter is stepped.
# ours_graph: ours with the whole step (forward, backward, capturable fused AdamW) replayed from a CUDA graph
# (liger_models/train/cuda_graph.py): the same kernels, no host time between them.
# Every ours* provider steps with the project's FusedAdamW (liger_models/train/optim.py, liger_models/kernels/ops/adamw.py), the
# one `liger-models train` builds; ours_torch_adamw is ours with torch's fused AdamW instead (the HF providers').
# ours_compile: ours under torch.compile(fullgraph=True), inductor: the kernels are custom ops in one graph
# (liger_models/kernels/_custom_ops.py), inductor compiles what lies between them.
PROVIDERS = ("ours", "ours_inbwd", "ours_graph", "ours_torch_adamw", "ours_compile", "hf", "hf_compile", "hf_liger")
WARMUP, STEPS = 4, 8
H200_BF16_PEAK_TFLOPS = 989.0


def flops_per_token(cfg: dict, seq: int) -> float:
    """6·(matmul params a token uses, incl. lm_head) + causal attention (6·T·Hq·d per layer, fwd+bwd). A sparse
    layer counts its router and the num_experts_per_tok experts a token runs through (the configs here have every
    layer sparse)."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    mlp = 3 * h * i
    if experts:
        mlp = h * experts + cfg["num_experts_per_tok"] * 3 * h * cfg.get("moe_intermediate_size", i)
    per_layer = h * hq * d + 2 * h * hkv * d + hq * d * h + mlp
    dense = n * per_layer + cfg["vocab_size"] * h
    return 6 * dense + n * 6 * seq * hq * d


def liger_modules(model) -> list[str]:
    """Names of the liger-kernel module classes in ``model`` (empty: its patch is not active)."""
    return sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("liger_kernel")})


def require_liger_patch(model, provider: str) -> None:
    """Refuses to measure a liger-kernel provider whose patch did not take (no liger_kernel module in the model)."""
    if not liger_modules(model):
        raise RuntimeError(f"{provider}: liger-kernel's patch is not active: no liger_kernel module in the model")


def _build(provider: str, cfg: dict):
    import torch

    if provider.startswith("ours"):
        from liger_models.auto import model_class

        cls = model_class(cfg["model_type"])
        model = cls.from_config(cls.config_class.from_hf(dict(cfg)), dtype=torch.bfloat16, device="cuda")
        return torch.compile(model, fullgraph=True) if provider == "ours_compile" else model
    import transformers

    if provider == "hf_liger":
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{cfg['model_type']}")()
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = HF_ATTENTION.get(cfg["model_type"], "sdpa")
    hf_cfg.use_cache = False  # training: no KV cache (its config default would build and fill one every forward)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16,
                                                              attn_implementation=hf_cfg._attn_implementation)
    if provider == "hf_liger":
        require_liger_patch(model, provider)
    if provider == "hf_compile":
        model = torch.compile(model)
    return model


def training_step(name: str, provider: str, n_batches: int):
    """(model, optimizer, random token batches, step) for one config and provider; ``step(i)`` trains on batch i
    (forward, backward, fused AdamW step) and returns the loss tensor. Shared with tools/profile_e2e.py and
    tools/memory_at_peak.py."""
    import torch

    cfg, batch, seq = CONFIGS[name]
    torch.manual_seed(0)
    model = _build(provider, cfg)
    model.train()
    graphed = provider == "ours_graph"
    if provider.startswith("ours") and provider != "ours_torch_adamw":
        from liger_models.train.optim import FusedAdamW

        opt = FusedAdamW(model.parameters(), lr=1e-5, capturable=graphed)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=graphed)
    in_backward = provider == "ours_inbwd"
    ids_checked = provider.startswith("ours") and os.environ.get("LIGER_BENCH_IDS_CHECKED", "0") == "1"
    if in_backward:
        from liger_models.train.step_in_backward import OptimizerInBackward
        from liger_models.train.trainer import CausalLMTask

        # an untied lm_head is stepped inside the forward, where linear-CE has its gradient
        OptimizerInBackward(opt, in_forward=CausalLMTask.loss_weights_used_once(model))
    # the same tokens for every provider: a generator of its own, not the one each model's init consumed
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (n_batches, batch, seq), device="cuda", generator=gen)

    def train_on(tokens):
        if ids_checked:  # as liger-models train runs its steps: the dataset's ids were checked when it was built
            from liger_models.modules.inputs import token_ids_checked_already

            with token_ids_checked_already():
                loss = model(input_ids=tokens, labels=tokens).loss
        else:  # as a user's own loop calls forward: one read of the ids' range per call
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        if not in_backward:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    if graphed:  # warm-up calls run eagerly, the next one captures: keep WARMUP > 3 so timing sees replays only
        from liger_models.train.cuda_graph import GraphedStep

        graph = GraphedStep(lambda b: train_on(b["ids"]), opt, warmup=WARMUP - 1,
                            label_keys={"ids": (cfg["vocab_size"], -100)})
        return model, opt, ids, lambda i: graph({"ids": ids[i]})
    return model, opt, ids, lambda i: train_on(ids[i])


def _worker(name: str, provider: str, budget: float) -> dict:
    import torch
    from harness import apply_tunables

    tuned = apply_tunables() if provider.startswith("ours") else {}
    cfg, batch, seq = CONFIGS[name]
    model, _, _, step = training_step(name, provider, WARMUP + STEPS)
    forward = type(getattr(model, "_orig_mod", model)).forward
    patched = dict(liger_modules=liger_modules(model), forward=f"{forward.__module__}.{forward.__qualname__}")
    if provider.startswith("hf") and ("num_experts" in cfg or "num_local_experts" in cfg):
        patched["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    t0 = time.perf_counter()
    step(0)  # under torch.compile this call compiles: its time is the compile's cost on top of a step
    torch.cuda.synchronize()
    patched["first_step_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    step(1)
    torch.cuda.synchronize()
    # A budget (--budget) bounds a provider whose steps take seconds (HF + liger-kernel's MoE path): when the steps
    # would pass it, the rest of the warm-up is skipped and the measurement stops at the first step past it, tokens/s
    # over the steps it ran. Below it every step runs as without one (no synchronisation between steps).
    bounded = budget > 0 and (time.perf_counter() - t0) * (WARMUP - 2 + STEPS) > budget
    for i in range(2, 2 if bounded else WARMUP):
        step(i)
    torch.cuda.synchronize()
    if provider != "ours_graph":  # a replay allocates nothing: the graph's peak is the capture's, kept
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    measured = 0
    for i in range(WARMUP, WARMUP + STEPS):
        loss = step(i)
        measured += 1
        if bounded:
            torch.cuda.synchronize()
            if time.perf_counter() - t0 > budget:
                break
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tok_s = measured * batch * seq / dt
    mfu = tok_s * flops_per_token(cfg, seq) / (H200_BF16_PEAK_TFLOPS * 1e12)
    return dict(config=name, provider=provider, tokens_per_s=tok_s, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                reserved_gib=torch.cuda.memory_reserved() / 2**30, loss=float(loss), tuned=tuned, **patched, mfu=mfu,
                measured_steps=measured)


def _load_rows(path: str) -> list[dict]:
    """Rows from a bench_e2e JSON ({"results": [...]}) or from a JSONL of the rows it prints."""
    with open(path) as f:
        text = f.read()
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)["results"]


def plot(out_png: str, paths: list[str]) -> None:
    """Grouped bars per config: tokens/s (top) and peak memory (bottom), one bar per provider; later files win."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {}
    for path in paths:
        for r in _load_rows(path):
            if not r.get("error"):
                rows[(r["config"], r["provider"])] = r
    configs = [c for c in CONFIGS if any(k[0] == c for k in rows)]
    providers = [p for p in PROVIDERS if any(k[1] == p for k in rows)]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    width = 0.8 / len(providers)
    for j, p in enumerate(providers):
        xs = [i + (j - (len(providers) - 1) / 2) * width for i in range(len(configs))]
        for ax, key, scale in ((axes[0], "tokens_per_s", 1e3), (axes[1], "peak_gib", 1)):
            ax.bar(xs, [rows[(c, p)][key] / scale if (c, p) in rows else 0 for c in configs], width, label=p)
    axes[0].set_ylabel("k tokens/s (higher is better)")
    axes[1].set_ylabel("peak GiB (lower is better)")
    axes[1].set_xticks(range(len(configs)), configs, rotation=15)
    axes[0].legend(ncol=len(providers))
    fig.suptitle("training step, H200, bf16, fused AdamW")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--timeout", type=int, default=300, help="seconds per (config, provider) subprocess")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds for the measured steps of a provider whose steps would take longer (0: no bound)")
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "PROVIDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from harness import arm_stack_dumps

        arm_stack_dumps()
        print("RESULT " + json.dumps(_worker(*args.worker, args.budget)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import environment, run_worker

    rows = []
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    for name in args.configs.split(","):
        for provider in args.providers.split(","):
            t0 = time.time()
            log = os.path.join(logs, f"{name}-{provider}.stderr")  # the worker's stderr, kept even when it is killed
            row, timed_out, err = run_worker([__file__, "--worker", name, provider, "--budget", str(args.budget)],
                                             log, args.timeout)
            if timed_out:
                row = dict(config=name, provider=provider, error="timeout", stderr_log=log,
                           stderr_tail=err[-12:])  # the stacks dumped before the kill end the log
            elif row is None:
                oom = any("OutOfMemory" in l for l in err)
                row = dict(config=name, provider=provider, error="OOM" if oom else (err[-1] if err else "no output"),
                           stderr_tail=err[-6:])  # enough of a traceback to see where it broke
            row["wall_s"] = round(time.time() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
        json.dump({"env": environment(), "results": rows}, f, indent=1)
    providers = args.providers.split(",")
    print("\n| config | batch×seq | " + " | ".join(providers) + " |")
    print("|---|---|" + "---|" * len(providers))
    for name in args.configs.split(","):
        _, b, s = CONFIGS[name]
        cells = []
        for p in providers:
            r = next(r for r in rows if r["config"] == name and r["provider"] == p)
            cells.append(r.get("error") or f"{r['tokens_per_s'] / 1e3:.1f}k tok/s, {r['peak_gib']:.1f} GiB, MFU {r['mfu']:.0%}"
                         + (f", first step {r['first_step_s']:.0f} s" if p.endswith("compile") else "")
                         + (f", {r['measured_steps']} steps" if r.get("measured_steps", STEPS) < STEPS else ""))
        print(f"| {name} | {b}×{s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
