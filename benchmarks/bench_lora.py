"""LoRA / QLoRA training step (issue 35): tokens/s and peak memory, every provider side by side on one GPU.

Shapes: Qwen2.5-7B and Llama-3.1-8B (full depth, random init, bf16 weights), LoRA r=16, alpha=32 on every linear of
the decoder, AdamW on the adapters, random tokens; each case with and without per-layer activation checkpointing.
Mixture-of-experts shapes (qwen3-30b-a3b-w4l, mixtral-8x7b-w2l: bench_e2e's, a few layers at real width) adapt the
routers and expert stacks too, as PEFT's all-linear does there.
Providers:
    hf_peft            transformers + PEFT (SDPA)
    hf_peft_liger      + liger-kernel's patch (apply_liger_kernel_to_<family>)
    hf_peft_bnb        QLoRA: bitsandbytes NF4 (double quant) base, prepare_model_for_kbit_training
    hf_peft_bnb_liger  the same + liger-kernel
    hf_peft_dora       transformers + PEFT with use_dora (DoRA)
    ours               liger_models.lora (fused LoRA in the packed projections)
    ours_qlora         ours on an NF4 base (liger_models.lora.quantize_base_)
    ours_offload       ours with the layer checkpoints in host memory (activation_checkpointing_enable(offload=True);
                       with --checkpointing on only)
    ours_qlora_offload ours_qlora with the checkpoints in host memory (the same; for --longest)
    ours_qlora_chunks  ours_qlora with each MLP run in checkpointed chunks of 8192 rows (mlp_chunking_enable; for
                       --longest: one more MLP forward a step, for a fraction of a layer's per-token memory)
    ours_dora          ours with use_dora (DoRA's magnitudes in the fused paths)
    ours_autocast      ours with its forward under bf16 autocast, as HF Trainer(bf16=True) and TRL (bf16 by default)
                       run it; the model then runs without autocast (native_precision): the same step as ours
The HF peers' forward runs under bf16 autocast, as HF Trainer(bf16=True) and TRL run it (step_context).
Each (config, provider, checkpointing) runs in its own subprocess (an OOM or a monkey-patch never leaks).

    python benchmarks/bench_lora.py --out DIR [--configs qwen2.5-7b,llama-3.1-8b] [--providers ...]
        [--batch 4 --seq 4096] [--checkpointing both|on|off] [--dropout 0.1]
    python benchmarks/bench_lora.py --out DIR --longest [--providers ...] [--longest-budget 240]
        [--longest-from 4096 --longest-growth 2]

--longest: the longest batch-1 sequence (a multiple of 1024) one full training step of Llama-3.1-8B fits in, for the
QLoRA providers. One subprocess per provider builds the model once (checkpointing on) and searches in-process: the
length grows from --longest-from (4096) by --longest-growth (2) up to the first OutOfMemoryError (at most 1 << 20),
then bisects between the last success and that failure down to 1024. Past ~130k tokens a Llama-3.1-8B step takes
close to a minute and grows as T² (attention), so a provider known to fit that far is searched from there in smaller
steps (e.g. --longest-from 163840 --longest-growth 1.25) instead of re-running the short probes. The number is a
lower bound: after an OOM the caching allocator is emptied but the next probe may still meet a more fragmented heap
than a fresh process would. The search stops once --longest-budget seconds (per provider, build included) are spent
or the next probe would end past them (a step's time grows at most quadratically with its length), and then reports
what it found with budget_hit true.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import CONFIGS as E2E_CONFIGS  # noqa: E402
from bench_e2e import require_liger_patch  # noqa: E402

CONFIGS = {
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
# Mixture-of-experts shapes of bench_e2e.py (real widths, a few layers): all-linear adapts the attention, the routers
# and both expert stacks on every provider (PEFT's target_parameters; ours inside the grouped expert GEMMs).
MOE_CONFIGS = ("qwen3-30b-a3b-w4l", "mixtral-8x7b-w2l")
CONFIGS.update({name: E2E_CONFIGS[name][0] for name in MOE_CONFIGS})
PROVIDERS = ("hf_peft", "hf_peft_liger", "hf_peft_bnb", "hf_peft_bnb_liger", "hf_peft_dora", "ours", "ours_qlora",
             "ours_offload", "ours_qlora_offload", "ours_qlora_chunks", "ours_dora", "ours_autocast")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 16, 32
WARMUP, STEPS = 3, 6


def _bnb_linears(model, torch, device: str):
    """Every decoder nn.Linear → bitsandbytes Linear4bit (NF4, double quant, bf16 compute), quantised on the GPU one
    at a time from the bf16 weight already there (what from_pretrained(quantization_config=...) does, without a
    checkpoint on disk; Params4bit quantises on its first move to a device, the one it is on included). The module is
    made on the meta device: its own weight is replaced at once, and made on the CPU its random init took ~45 s of
    the 8B build (H100, 2026-12-06)."""
    import bitsandbytes as bnb

    for name, module in list(model.named_modules()):
        if not name.startswith("model.layers.") or not isinstance(module, torch.nn.Linear):
            continue
        q = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=module.bias is not None,
                              compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                              device="meta")
        q.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, compress_statistics=True,
                                     quant_type="nf4").to(device)
        if module.bias is not None:
            q.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)


def _build(provider: str, cfg: dict, checkpointing: bool, device: str = "cuda"):
    """The provider's model, adapters added; also on the CPU (tests/benchmarks check how each is built)."""
    import torch

    if provider.startswith("ours"):
        from liger_models.auto import model_class
        from liger_models.lora import LoraSettings, add_lora, quantize_base_

        cls = model_class(cfg["model_type"])
        model = cls.from_config(cls.config_class.from_hf(dict(cfg)), dtype=torch.bfloat16, device=device)
        if provider.startswith("ours_qlora"):
            quantize_base_(model)
            torch.cuda.empty_cache()  # a no-op where CUDA was never initialised (the CPU builds of tests/benchmarks)
        add_lora(model, LoraSettings(r=R, alpha=ALPHA, targets="all-linear", dropout=_dropout(),
                                     use_dora=provider == "ours_dora"))
        if checkpointing:
            model.activation_checkpointing_enable(offload=provider.endswith("_offload"))
        if provider.endswith("_chunks"):
            model.mlp_chunking_enable(8192)
        return model
    import peft
    import transformers

    if "liger" in provider:
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{cfg['model_type']}")()
    config = transformers.AutoConfig.for_model(**cfg)
    config.use_cache = False  # training: no KV cache (HF drops it itself only under checkpointing)
    bnb = "bnb" in provider
    with torch.device(device):  # random init on the CPU took minutes at 8B
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    if "liger" in provider:
        require_liger_patch(model, provider)
    if bnb:
        _bnb_linears(model, torch, device)
        model.to(device)
        # the mark from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True)) leaves: without it
        # prepare_model_for_kbit_training casts to fp32 but silently skips the activation checkpointing it was asked for
        model.is_loaded_in_4bit = True
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                                     gradient_checkpointing_kwargs={"use_reentrant": False})
    elif checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    layers_checkpointed = {bool(getattr(m, "gradient_checkpointing", False)) for m in model.model.layers}
    if layers_checkpointed != {checkpointing}:
        raise RuntimeError(f"{provider}: activation checkpointing of the decoder layers is {layers_checkpointed}, "
                           f"asked for {checkpointing}")
    targets = "all-linear" if "num_experts_per_tok" in cfg else TARGETS  # MoE: PEFT maps it to its parameters
    return peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets,
                                                      lora_dropout=_dropout(), task_type="CAUSAL_LM",
                                                      use_dora=provider == "hf_peft_dora"))


def _dropout() -> float:
    """Every provider's lora_dropout (--dropout, handed to the worker processes through the environment)."""
    return float(os.environ.get("LIGER_BENCH_LORA_DROPOUT", "0"))


def step_context(provider: str, torch):
    """What the forward of a step runs under: the HF peers under bf16 autocast, as HF Trainer(bf16=True) and TRL run
    them. prepare_model_for_kbit_training keeps the norms, embeddings and lm_head in fp32 and PEFT keeps the adapters
    in fp32, so without autocast the QLoRA peer's residual stream, attention and logits all run in fp32 (a third of
    the speed its users get); ours is bf16 throughout by construction and computes its norms in fp32 itself."""
    import contextlib

    if provider.startswith("ours") and provider != "ours_autocast":
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


def _built(provider: str, cfg: dict, checkpointing: bool):
    """(model in train mode, fused AdamW over its trainable parameters, seconds the build took)."""
    import torch

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = _build(provider, cfg, checkpointing)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    return model, opt, build_s


def lora_training_step(name: str, provider: str, n_batches: int, batch: int, seq: int, checkpointing: bool):
    """(model, optimizer, random token batches, step, forward context) for one config and provider, built as the
    benchmark builds them: ``step(i)`` trains on batch i (forward under the provider's ``step_context``, backward,
    fused AdamW step) and returns the loss; ``context()`` is what a forward runs under. Shared with
    tools/profile_e2e.py --lora."""
    import torch

    cfg = CONFIGS[name]
    model, opt, _ = _built(provider, cfg, checkpointing)
    ids = torch.randint(0, cfg["vocab_size"], (n_batches, batch, seq), device="cuda")

    def step(i: int):
        with step_context(provider, torch):
            loss = model(input_ids=ids[i], labels=ids[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, opt, ids, step, lambda: step_context(provider, torch)


def _worker(name: str, provider: str, batch: int, seq: int, checkpointing: bool, steps: int = STEPS) -> dict:
    import torch

    t0 = time.perf_counter()
    _, opt, _, step, _ = lora_training_step(name, provider, WARMUP + steps, batch, seq, checkpointing)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = [p for group in opt.param_groups for p in group["params"]]
    torch.cuda.reset_peak_memory_stats()
    start = None
    for i in range(WARMUP + steps):
        if i == WARMUP:
            torch.cuda.synchronize()
            start = time.perf_counter()
            warmup_s = start - t0 - build_s
        loss = step(i)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return dict(config=name, provider=provider, batch=batch, seq=seq, checkpointing=checkpointing,
                tokens_per_s=steps * batch * seq / elapsed, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                trainable=sum(p.numel() for p in params), loss=float(loss), build_s=round(build_s, 1),
                warmup_s=round(warmup_s, 1))


def _run(args: list[str], timeout: int = 1800, flag: str = "--worker") -> dict:
    proc = subprocess.run([sys.executable, __file__, flag, *args], capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        oom = "OutOfMemoryError" in tail or "out of memory" in tail
        return dict(error="OOM" if oom else tail)
    return json.loads(lines[-1])


def _step(model, opt, vocab: int, seq: int, torch, provider: str) -> None:
    """One training step on random tokens of shape (1, seq). Its tensors live in this frame only, so once an OOM's
    traceback is gone nothing of the step is left."""
    ids = torch.randint(0, vocab, (1, seq), device="cuda")
    with step_context(provider, torch):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _probe(model, opt, vocab: int, seq: int, torch, provider: str) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    error = None
    try:
        _step(model, opt, vocab, seq, torch, provider)
        result = "ok"
    except torch.cuda.OutOfMemoryError:  # not bound: leaving this block drops the exception and its frames
        result = "oom"
    except Exception as exc:  # anything else ends the search; the row keeps what was found
        result, error = "error", f"{type(exc).__name__}: {exc}"[-2000:]
        del exc
    seconds = time.perf_counter() - t0
    if result != "ok":
        # Gradients the failed backward accumulated, then the cycles among the unwound frames, then the cache.
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    row = dict(seq=seq, result=result, s=round(seconds, 2))
    if result == "ok":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if error:
        row["error"] = error
    return row


def search_longest(fits, lo: int, growth: float, hi: int) -> tuple[int, int | None, int | None]:
    """(the longest length ``fits`` says True for, or 0; the shortest length found not to fit; the first one found
    not to fit): lengths grow from ``lo`` by ``growth`` (multiples of 1024, at least 1024 more each time, at most
    ``hi``) up to the first that does not fit, then bisect between the last that did and it, down to 1024 apart.
    ``fits(seq)``: True / False, or None to stop the search where it stands (what was found is kept)."""
    best, bad, first_bad = 0, None, None
    seq = lo
    while True:
        ok = fits(seq)
        if not ok:
            break
        best = seq
        if seq >= hi:
            break
        seq = min(max(int(seq * growth) // 1024 * 1024, seq + 1024), hi)
    if ok is False:
        bad = first_bad = seq
        while bad - best > 1024:
            mid = (best + bad) // 2 // 1024 * 1024
            ok = fits(mid)
            if ok is None:
                break
            if ok:
                best = mid
            else:
                bad = mid
    return best, bad, first_bad


def _longest_worker(name: str, provider: str, budget: float, lo: int = 4096, growth: float = 2.0,
                    hi: int = 1 << 20) -> dict:
    """The longest batch-1 sequence one training step fits in, on one model built once (see the module's docstring)."""
    t_start = time.perf_counter()
    import torch

    cfg = CONFIGS[name]
    model, opt, build_s = _built(provider, cfg, checkpointing=True)
    probes, budget_hit, error = [], False, None
    best = dict(seq=0, s=None, peak_gib=None)  # the longest probe that fit so far (none yet: length 0)

    def attempt(seq: int) -> bool | None:
        """True / False: the step fit / ran out of memory; None: the search stops (budget or another error)."""
        nonlocal budget_hit, error, best
        elapsed = time.perf_counter() - t_start
        predicted = best["s"] * (seq / best["seq"]) ** 2 if best["seq"] else 0.0
        if elapsed + predicted > budget:
            budget_hit = True
            return None
        probes.append(_probe(model, opt, cfg["vocab_size"], seq, torch, provider))
        print(json.dumps(probes[-1]), file=sys.stderr, flush=True)
        if probes[-1]["result"] == "error":
            error = probes[-1]["error"]
            return None
        if probes[-1]["result"] == "ok":
            best = probes[-1]  # the search only probes past the longest fit so far
            return True
        return False

    _, bad, first_oom = search_longest(attempt, lo, growth, hi)
    return dict(config=name, provider=provider, longest_seq=best["seq"], first_oom_seq=first_oom,
                min_oom_seq=bad, peak_gib=best["peak_gib"], step_s=best["s"],
                build_s=round(build_s, 1), total_s=round(time.perf_counter() - t_start, 1), budget_s=budget,
                budget_hit=budget_hit, error=error,
                probes=[{k: v for k, v in p.items() if k != "error"} for p in probes],
                device=torch.cuda.get_device_name(0),
                gpu_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=6, metavar=("CONFIG", "PROVIDER", "BATCH", "SEQ", "CKPT", "STEPS"))
    p.add_argument("--longest-worker", nargs=5, metavar=("CONFIG", "PROVIDER", "BUDGET", "FROM", "GROWTH"))
    p.add_argument("--out")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--checkpointing", choices=("both", "on", "off"), default="both")
    p.add_argument("--dropout", type=float, default=0.0, help="every provider's lora_dropout (default 0)")
    p.add_argument("--longest", action="store_true", help="longest batch-1 QLoRA sequence of llama-3.1-8b instead")
    p.add_argument("--longest-budget", type=float, default=240.0,
                   help="seconds per provider for --longest, build included (default 240)")
    p.add_argument("--longest-from", type=int, default=4096, help="--longest's first length (a multiple of 1024)")
    p.add_argument("--longest-growth", type=float, default=2.0,
                   help="--longest's factor from one fitting length to the next (> 1; default 2)")
    args = p.parse_args()
    if args.longest_growth <= 1 or args.longest_from <= 0 or args.longest_from % 1024:
        p.error("--longest-from must be a positive multiple of 1024 and --longest-growth above 1")
    if args.worker:
        name, provider, batch, seq, ckpt, steps = args.worker
        print(json.dumps(_worker(name, provider, int(batch), int(seq), ckpt == "1", int(steps))))
        return
    if args.longest_worker:
        name, provider, budget, lo, growth = args.longest_worker
        print(json.dumps(_longest_worker(name, provider, float(budget), int(lo), float(growth))))
        return
    if not args.out:
        p.error("--out DIR is required")
    os.makedirs(args.out, exist_ok=True)
    os.environ["LIGER_BENCH_LORA_DROPOUT"] = str(args.dropout)
    rows = []
    providers = args.providers.split(",")
    if args.longest:
        for provider in [p for p in providers if "bnb" in p or "qlora" in p]:
            try:  # the budget is checked between probes: one probe (minutes at most) may run past it
                row = _run(["llama-3.1-8b", provider, str(args.longest_budget), str(args.longest_from),
                            str(args.longest_growth)], timeout=int(args.longest_budget) + 900,
                           flag="--longest-worker")
            except subprocess.TimeoutExpired:
                row = dict(error="timeout")
            row.update(config="llama-3.1-8b", provider=provider)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
            _save(args.out, rows)
    else:
        ckpts = {"both": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
        for name in args.configs.split(","):
            for ckpt in ckpts:
                for provider in providers:
                    if provider.endswith("_offload") and not ckpt:  # offloads what the checkpoints save: none here
                        continue
                    row = _run([name, provider, str(args.batch), str(args.seq), "1" if ckpt else "0", str(STEPS)])
                    row.update(config=name, provider=provider, checkpointing=ckpt, dropout=args.dropout)
                    rows.append(row)
                    print(json.dumps(rows[-1]), flush=True)
                    _save(args.out, rows)  # after every row: a run stopped by a time limit keeps what it measured
    _save(args.out, rows)


def _save(out: str, rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_lora.json"), "w") as f:
        json.dump({"results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
