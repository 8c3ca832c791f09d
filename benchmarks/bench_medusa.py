"""Medusa training step at Llama-3-8B width: tokens/s and peak memory, this project vs HF-style and Liger-style.

Model: hidden 4096, intermediate 14336, 32/8 heads, vocab 128256, 4 decoder layers (so it fits one H200), random
init, bf16 weights, SDPA/flash attention, no activation checkpointing; 5 Medusa heads (1 ResBlock each), either with
their own lm_head copies ("copy") or the shared frozen base lm_head ("shared"); head k weighted 0.2·0.8^k; stage 1
(frozen base under no_grad, heads only) and stage 2 (joint, base CE on); fused AdamW (heads at lr × 4 for ours;
ours steps with the project's FusedAdamW, the baselines with torch's).
Random tokens, every one a target. A step is forward + backward + optimizer step; tokens/s over STEPS steps after
warm-up; peak = torch.cuda.max_memory_allocated over those steps (weights, grads and optimizer state included).

Providers:
  liger-models  MedusaModel: our fused model; every head is fused linear-CE (loss_scale, frozen shared weight).
  liger-models-inbwd  the same with the optimizer step inside backward (liger_models/train/step_in_backward.py):
                identical updates, each gradient freed as soon as its parameter is stepped; the heads' own
                lm_heads already in the forward, the moment linear-CE has their dW (one V×H dW at a time).
  hf-style      transformers LlamaForCausalLM + per-head ResBlock → logits materialised, upcast to fp32, CE.
  liger-style   the same model patched by liger-kernel's apply_liger_kernel_to_llama, and
                LigerFusedLinearCrossEntropyLoss per head on the ResBlock output (hidden[:, :-(k+2)] slices).
Each (provider, lm_head) pair runs in its own subprocess (OOMs, compile caches and liger-kernel's monkey-patch
never leak); inside it, shapes run in increasing token count and a shape at or above one that ran out of memory is
recorded as OOM without running.

    python benchmarks/bench_medusa.py --out DIR [--quick] [--providers liger-models,hf-style,liger-style]
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

MODEL = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
             rms_norm_eps=1e-5, max_position_embeddings=131072)
NUM_HEADS, LAMBDA0, DECAY, LR, HEAD_LR_MULT = 5, 0.2, 0.8, 1e-5, 4.0
SHAPES = [(8, 1024), (4, 2048), (2, 4096), (1, 8192), (1, 16384), (1, 32768), (1, 65536)]
QUICK_SHAPES = [(8, 1024), (1, 16384)]
PROVIDERS = ("liger-models", "liger-models-inbwd", "hf-style", "liger-style")
QUICK_RUNS = [("liger-models", "copy"), ("liger-models", "shared"), ("liger-models-inbwd", "copy"), ("hf-style", "copy"),
              ("liger-style", "copy")]
# The baselines are measured with copied lm_heads only (the table); ours both ways.
FULL_RUNS = [("liger-models", "copy"), ("liger-models", "shared"), ("liger-models-inbwd", "copy"),
             ("hf-style", "copy"), ("liger-style", "copy")]
WARMUP, STEPS, LONG_STEPS = 1, 3, 2  # LONG_STEPS for ≥ 32K-token steps (seconds each)
TIMEOUT_S = 420
DEVICE = "cuda"


# ---- worker side (one subprocess per provider × lm_head mode) ----------------------------------------------------

def _ours(lm_head: str, stage: int):
    import torch

    from liger_models.llama.config import LlamaConfig
    from liger_models.llama.modeling import LigerLlamaForCausalLM
    from liger_models.medusa import MedusaModel
    from liger_models.train.optim import FusedAdamW

    base = LigerLlamaForCausalLM.from_config(LlamaConfig.from_hf(dict(MODEL)), dtype=torch.bfloat16, device=DEVICE)
    model = MedusaModel.from_base(base, stage=stage, num_heads=NUM_HEADS, share_lm_head=lm_head == "shared",
                                  heads_coefficient=LAMBDA0, decay_coefficient=DECAY)
    opt = FusedAdamW(model.param_groups(LR, HEAD_LR_MULT), lr=LR)  # the project's AdamW (liger_models/kernels/ops/adamw.py)

    def loss_fn(ids):
        return model(ids, labels=ids).loss

    return model, opt, loss_fn


def _baseline(provider: str, lm_head: str, stage: int):
    """transformers Llama + Medusa heads computed head by head (the fork's math; ResBlocks applied in every path)."""
    import torch
    import torch.nn.functional as F
    import transformers

    from liger_models.medusa import MedusaConfig, MedusaHeads

    if provider == "liger-style":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # RoPE, RMSNorm, SwiGLU (and its FLCE forward, unused: we call .model)
        flce = LigerFusedLinearCrossEntropyLoss()
    cfg = transformers.AutoConfig.for_model(**MODEL)
    cfg._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if provider == "liger-style" and not any(type(m).__module__.startswith("liger_kernel") for m in base.modules()):
        raise RuntimeError("liger-kernel's patch is not active: no liger_kernel module in the model")
    base.requires_grad_(stage == 2)
    heads = MedusaHeads(MedusaConfig(num_heads=NUM_HEADS, share_lm_head=lm_head == "shared",
                                     hidden_size=MODEL["hidden_size"], vocab_size=MODEL["vocab_size"]), base.lm_head)
    weights = [LAMBDA0 * DECAY**k for k in range(1, NUM_HEADS + 1)]
    groups = [{"params": list(heads.parameters()), "lr": LR * HEAD_LR_MULT}]
    if stage == 2:
        groups.append({"params": list(base.parameters()), "lr": LR})
    opt = torch.optim.AdamW(groups, lr=LR, fused=True)

    def ce(z, w, ids, shift):
        H = z.shape[-1]
        if provider == "liger-style":
            return flce(w, z[:, :-shift].reshape(-1, H), ids[:, shift:].reshape(-1))
        logits = F.linear(z[:, :-shift], w).float()  # (B, T - shift, V) materialised, then upcast
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, shift:].reshape(-1))

    def loss_fn(ids):
        with torch.set_grad_enabled(stage == 2):
            hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state
        loss = ce(hidden, base.lm_head.weight, ids, 1) if stage == 2 else 0.0
        for k in range(NUM_HEADS):
            z = hidden
            for block in heads.resblocks(k):
                z = block(z)
            loss = loss + weights[k] * ce(z, heads.weight(k), ids, k + 2)
        return loss

    return (base, heads), opt, loss_fn


def _measure(loss_fn, opt, B: int, T: int, in_backward: bool) -> dict:
    import torch

    steps = STEPS if B * T < 32768 else LONG_STEPS
    gen = torch.Generator(device=DEVICE).manual_seed(1)  # the same tokens for every provider
    ids = torch.randint(0, MODEL["vocab_size"], (WARMUP + steps, B, T), device=DEVICE, generator=gen)

    def step(i):
        loss_fn(ids[i]).backward()
        if not in_backward:  # else backward already stepped every parameter and freed its gradient
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for i in range(WARMUP):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(WARMUP, WARMUP + steps):
        step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return dict(ms=dt * 1e3, tokens_per_s=B * T / dt, peak_mib=torch.cuda.max_memory_allocated() / harness.MiB)


def worker(spec: dict) -> None:
    """Measure every (stage, shape) of one (provider, lm_head) pair; each row goes to stderr as one JSON line."""
    import torch

    tuned = harness.apply_tunables() if spec["provider"].startswith("liger-models") else {}
    for stage in spec["stages"]:
        torch.manual_seed(0)
        in_backward = spec["provider"] == "liger-models-inbwd"
        if spec["provider"].startswith("liger-models"):
            holder, opt, loss_fn = _ours(spec["lm_head"], stage)
            if in_backward:
                from liger_models.train.step_in_backward import OptimizerInBackward
                from liger_models.train.trainer import MedusaTask

                # the heads' own lm_heads (and stage 2's untied base lm_head) are stepped inside the forward
                hooks = OptimizerInBackward(opt, in_forward=MedusaTask.loss_weights_used_once(holder))
        else:
            holder, opt, loss_fn = _baseline(spec["provider"], spec["lm_head"], stage)
        oom_at = None
        for B, T in spec["shapes"]:
            row = dict(provider=spec["provider"], lm_head=spec["lm_head"], stage=stage, B=B, T=T, tuned=tuned)
            if oom_at is not None and B * T >= oom_at[0] * oom_at[1]:
                row["error"] = f"OOM (as at {oom_at[0]}x{oom_at[1]})"
            else:
                try:
                    row.update(_measure(loss_fn, opt, B, T, in_backward))
                except torch.cuda.OutOfMemoryError:
                    row["error"], oom_at = "OOM", (B, T)
                opt.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps(row), file=sys.stderr, flush=True)
        if in_backward:
            hooks.remove()
            del hooks  # it holds the optimizer, and through it this stage's parameters and state
        del holder, opt, loss_fn
        gc.collect()
        torch.cuda.empty_cache()


# ---- driver side -----------------------------------------------------------------------------------------------------

def _run_worker(spec: dict) -> list[dict]:
    """Run one worker subprocess. Its rows stream to stderr as JSON lines, so a crash or timeout keeps the rows
    measured before it; every case it did not reach gets an error row (a missing liger-kernel is a skip note)."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        stderr, error = proc.stderr, None
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        error = f"timeout after {TIMEOUT_S} s"
    lines = stderr.strip().splitlines()
    rows = [json.loads(l) for l in lines if l.startswith('{"provider"')]
    sys.stderr.write("\n".join(l for l in lines if not l.startswith('{"provider"'))[-3000:] + "\n")
    if error is None:
        error = next((l for l in reversed(lines) if "Error" in l), lines[-1] if lines else "no output")
    if "liger_kernel" in error and "No module" in error:
        error = "skipped: liger-kernel not installed"
    done = {(r["stage"], r["B"], r["T"]) for r in rows}
    return rows + [dict(provider=spec["provider"], lm_head=spec["lm_head"], stage=s, B=B, T=T, error=error[:200])
                   for s in spec["stages"] for B, T in spec["shapes"] if (s, B, T) not in done]


def _case(r: dict) -> str:
    return f"stage {r['stage']} {r['lm_head']} lm_head {r['B']}x{r['T'] // 1024}K"


def _table(rows: list[dict], providers: list[str]) -> str:
    head = "| stage | lm_head | B×T | tokens | " + " | ".join(f"{p} tok/s, peak GiB" for p in providers) + " |"
    lines = [head, "|---|---|---|---|" + "---|" * len(providers)]
    keys = list(dict.fromkeys((r["stage"], r["lm_head"], r["B"], r["T"]) for r in rows))
    for stage, lm_head, B, T in sorted(keys, key=lambda k: (k[0], k[1], k[2] * k[3], k[3])):
        cells = []
        for p in providers:
            r = next((r for r in rows if (r["provider"], r["stage"], r["lm_head"], r["B"], r["T"]) ==
                      (p, stage, lm_head, B, T)), None)
            if r is None:
                cells.append("—")
            elif r.get("error"):
                cells.append(r["error"])
            else:
                cells.append(f"{r['tokens_per_s'] / 1e3:.1f}k, {r['peak_mib'] / 1024:.1f}")
        lines.append(f"| {stage} | {lm_head} | {B}×{T // 1024}K | {B * T // 1024}K | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    args = harness.parse_args(__doc__.splitlines()[0])
    providers = [p for p in (args.providers.split(",") if args.providers else PROVIDERS)]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    runs = QUICK_RUNS if args.quick else FULL_RUNS
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rows = []
    t0 = time.time()
    for provider, lm_head in runs:
        if provider in providers:
            rows += _run_worker(dict(provider=provider, lm_head=lm_head, stages=[1, 2], shapes=shapes))
            print(f"# {provider} {lm_head}: done at {time.time() - t0:.0f} s", flush=True)
    results = [harness.Result(_case(r), r["provider"], r.get("ms"), r.get("peak_mib"),
                              {k: v for k, v in r.items() if k not in ("ms", "peak_mib", "error")}, r.get("error"))
               for r in rows]
    meta = dict(model=MODEL, num_heads=NUM_HEADS, lambda0=LAMBDA0, decay=DECAY, warmup=WARMUP, steps=STEPS,
                wall_s=round(time.time() - t0, 1))
    harness.save("bench_medusa", args.out, results, meta)
    print(_table(rows, [p for p in PROVIDERS if p in providers]))


if __name__ == "__main__":
    main()
