"""Decoding speed, batch 1: plain greedy `generate` vs Medusa tree decoding (`medusa_generate`), and HF's generate.

What Medusa buys is fewer base-model forward calls: each step verifies a tree of candidates in one call and emits
the accepted ones plus the base's own next token. Whether that is faster depends on what a step costs compared with
one plain decoding step, so this script measures both on the same random-weight model:
  greedy ms/token   plain greedy decoding (`model.generate`, KV cache), per new token
  medusa ms/step    one tree step (heads' top-k, the verification call, acceptance, KV cache update), per step
  break-even        medusa ms/step ÷ greedy ms/token: the tokens a step must emit to tie with plain decoding
  speedup @ a       a × greedy ms/token ÷ medusa ms/step, at a tokens per step (trained Medusa-1 heads on Vicuna-7B
                    emit ~2.5–3.0 per step with the 63-node tree, docs/medusa.md)
Random heads accept almost nothing greedily, and typical acceptance (T 0.7, sampled roots) takes nearly every
candidate of a random base (its near-uniform p(x) ≈ 1/V beats the threshold 0.3·exp(−H) ≈ 0.3/V), so their own
tokens/step is reported but is not the point: ms/step is, at both temperatures. Each of ours runs
eagerly and with `cuda_graph=True` (every decoding call replayed as a CUDA graph). HF transformers' `generate`
(eager, dynamic cache) on the same weights is the peer for plain decoding; whether its tokens, the graphed ones and
greedy Medusa's equal our eager greedy tokens is recorded, but says little here: random bf16 weights give near-tied
logits, so any change of kernel flips some argmax (tests/models/test_graphed_decoding.py checks tokens in fp32).
graph_setup_ms: what a `cuda_graph=True` call pays once (static cache, warm-up step, capture).
greedy_graphed_stop_ids_ms_per_token: graphed plain decoding with a stop id that never comes (the loop then watches
for finished rows; the other plain columns decode with no stop ids).

Each time is the median of REPS wall-clock runs (CUDA synchronised) at two budgets, SHORT_TOKENS and NEW_TOKENS; the
difference over the extra tokens (or steps) leaves out the prefill and the one graph capture per call.

    python benchmarks/bench_medusa_decoding.py --out DIR [--quick]
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                 rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
LLAMA32_1B = dict(LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                  tie_word_embeddings=True)
CONFIGS = {"llama-3-8b": LLAMA3_8B, "llama-3.2-1b": LLAMA32_1B}
PROMPT_LENS = (128, 2048)
NEW_TOKENS = 80
SHORT_TOKENS = 16
NUM_HEADS = 5
REPS = 3
ACCEPTANCE = (2.0, 2.5, 3.0)
TEMPERATURES = (0.0, 0.7)  # greedy, and typical acceptance (sampled roots)
DEVICE = "cuda"


def _wall_ms(fn, *args, **kwargs) -> float:
    import torch

    times = []
    for _ in range(REPS):
        sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _hf_model(cfg: dict, state: dict):
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device(DEVICE):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16)
    hf.load_state_dict(state, strict=False)  # a tied lm_head is absent from ours and rebuilt by HF
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def _per_unit_ms(run, units) -> float:
    """ms per token (or per step) in steady state: two budgets, so the prefill and any capture cancel out."""
    short, long = (_wall_ms(run, n) for n in (SHORT_TOKENS, NEW_TOKENS))
    return (long - short) / (units(NEW_TOKENS) - units(SHORT_TOKENS))


def measure(name: str, cfg: dict, quick: bool) -> list[dict]:
    import torch

    from liger_models.llama.config import LlamaConfig
    from liger_models.llama.modeling import LigerLlamaForCausalLM
    from liger_models.medusa import MedusaModel
    from liger_models.medusa.decoding import medusa_generate

    torch.manual_seed(0)
    base = LigerLlamaForCausalLM.from_config(LlamaConfig.from_hf(dict(cfg)), dtype=torch.bfloat16, device=DEVICE)
    base.eval()
    lens = PROMPT_LENS[:1] if quick else PROMPT_LENS
    prompts = {n: torch.randint(0, cfg["vocab_size"], (1, n), device=DEVICE) for n in lens}
    greedy, greedy_ms = {}, {}
    with torch.no_grad():
        for n, ids in prompts.items():
            greedy[n] = base.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
            for graph in (False, True):
                run = lambda k: base.generate(ids, max_new_tokens=k, eos_token_id=[], cuda_graph=graph)  # noqa: E731
                greedy_ms[n, graph] = _per_unit_ms(run, lambda k: k)
            greedy[n, True] = torch.equal(base.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                                        cuda_graph=True), greedy[n])
            # With stop ids the loop must learn when every row has finished (generate.FinishWatch); the last id
            # of the vocabulary as the stop id, which these random weights do not emit here (checked).
            stop = [cfg["vocab_size"] - 1]
            full = base.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=stop, cuda_graph=True)
            if full.shape[1] == n + NEW_TOKENS:
                run = lambda k: base.generate(ids, max_new_tokens=k, eos_token_id=stop, cuda_graph=True)  # noqa: E731
                greedy_ms[n, "stop ids"] = _per_unit_ms(run, lambda k: k)
            # What one call pays to set the graph up (static cache, eager warm-up step, capture): two new tokens
            # graphed minus eager, i.e. one graphed step's setup instead of one eager step.
            greedy[n, "setup"] = (_wall_ms(base.generate, ids, max_new_tokens=2, eos_token_id=[], cuda_graph=True)
                                  - _wall_ms(base.generate, ids, max_new_tokens=2, eos_token_id=[]))
    rows = []
    for lm_head in ("copy", "shared"):
        medusa = MedusaModel.from_base(base, stage=1, num_heads=NUM_HEADS, share_lm_head=lm_head == "shared")
        medusa.heads.to(device=DEVICE, dtype=torch.bfloat16)
        for module in medusa.heads.modules():  # trained-like blocks: a non-zero W, so the heads' proposals differ
            if isinstance(module, torch.nn.Linear) and module.weight.shape[0] == module.weight.shape[1]:
                torch.nn.init.normal_(module.weight, std=0.02)
        for (n, ids), graph, temperature in itertools.product(prompts.items(), (False, True), TEMPERATURES):
            with torch.no_grad():
                def run(k, stats=False):
                    generator = torch.Generator(DEVICE).manual_seed(0) if temperature else None
                    return medusa_generate(base, medusa.heads, ids, k, eos_token_id=[], return_stats=stats,
                                           cuda_graph=graph, temperature=temperature, generator=generator)

                out, steps = run(NEW_TOKENS, True)
                step_ms = _per_unit_ms(run, lambda k: len(run(k, True)[1]))
            ms = greedy_ms[n, graph]
            rows.append(dict(config=name, lm_head=lm_head, cuda_graph=graph, prompt_len=n, new_tokens=NEW_TOKENS,
                             temperature=temperature, greedy_ms_per_token=ms, medusa_ms_per_step=step_ms,
                             medusa_steps=len(steps), medusa_tokens_per_step=sum(steps) / len(steps),
                             medusa_equals_greedy=torch.equal(out, greedy[n]),
                             greedy_graphed_equals_eager=greedy[n, True], graph_setup_ms=greedy[n, "setup"],
                             greedy_graphed_stop_ids_ms_per_token=greedy_ms.get((n, "stop ids")),
                             break_even_tokens_per_step=step_ms / ms,
                             speedup_at={str(a): a * ms / step_ms for a in ACCEPTANCE}))
        medusa = None  # frees the heads before the next ones (a plain del would orphan the closures' name)
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    try:
        state = base.state_dict()
        hf = _hf_model(cfg, state)
        del state
        with torch.no_grad():
            for prompt_len, ids in prompts.items():
                same = torch.equal(hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                               do_sample=False), greedy[prompt_len])

                def run(k):
                    return hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)

                hf_ms = _per_unit_ms(run, lambda k: k)
                for r in rows:
                    if r["prompt_len"] == prompt_len:
                        r["hf_ms_per_token"], r["hf_tokens_equal_ours"] = hf_ms, same
        hf = None
    except Exception as e:  # noqa: BLE001 - the peer is optional; our numbers stand without it
        for r in rows:
            r["hf_error"] = repr(e)[:300]
    base = None
    torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return rows


def table(rows: list[dict]) -> str:
    head = ("| config | lm_head | T | CUDA graph | prompt | HF ms/token | greedy ms/token | medusa ms/step | "
            "break-even tok/step | " + " | ".join(f"speedup @{a}" for a in ACCEPTANCE) + " | random heads tok/step |")
    lines = [head, "|" + "---|" * (10 + len(ACCEPTANCE))]
    for r in rows:
        hf = f"{r['hf_ms_per_token']:.2f}" if "hf_ms_per_token" in r else "—"
        graphed = 'yes' if r['cuda_graph'] else 'no'
        lines.append(f"| {r['config']} | {r['lm_head']} | {r['temperature']:g} | {graphed} | {r['prompt_len']} | "
                     f"{hf} | {r['greedy_ms_per_token']:.2f} | "
                     f"{r['medusa_ms_per_step']:.2f} | {r['break_even_tokens_per_step']:.2f} | "
                     + " | ".join(f"{r['speedup_at'][str(a)]:.2f}×" for a in ACCEPTANCE)
                     + f" | {r['medusa_tokens_per_step']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0])
    tuned = harness.apply_tunables()
    names = ["llama-3-8b"] if args.quick else list(CONFIGS)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for name in names:  # the JSON is rewritten after each config: a run cut short keeps what it measured
        rows += measure(name, CONFIGS[name], args.quick)
        with open(os.path.join(args.out, "bench_medusa_decoding.json"), "w") as f:
            meta = dict(new_tokens=NEW_TOKENS, num_heads=NUM_HEADS, reps=REPS, tuned=tuned)
            json.dump({"env": harness.environment(), "meta": meta, "results": rows}, f, indent=1)
        print(table(rows), flush=True)


if __name__ == "__main__":
    main()
