"""Decoding several prompts at once: what a Medusa step costs against a plain step as the batch grows.

A plain decoding step of B rows reads the weights once for B tokens; a Medusa step verifies B trees of 1 + N nodes
(the default tree: 45) in one call, so it stays near a plain step's cost only while B · 45 tokens are still too
few to make the weights' read the smaller part. Per batch size, on random-weight Llama models in bf16, both
graphed (`cuda_graph=True`, as a user decoding for speed runs them), greedy, no stop ids:
  plain ms/step     plain `generate`, per step of B tokens (two budgets, so the prefill and capture cancel out)
  medusa ms/step    `medusa_generate` with 5 heads sharing the base's lm_head, per step of B trees: the default
                    45-node tree whole; the same cut for the batch as decoding cuts it by default
                    (`tree.tree_for_batch`, TREE_TOKENS per call: whole up to 2 rows, 24 nodes at 4, 12 at 8, 6
                    at 16); and a 9-node one (top-2 of head 1, then one token each from heads 2-4) whose
                    verification costs a fifth as much once the batch makes it compute-bound
  break-even        medusa ÷ plain: the tokens per row a step must emit to tie with plain decoding
  speedup @ a       a × plain ÷ medusa, at a tokens per row per step (trained heads: ~2.5-3, docs/medusa.md)
Random heads accept almost nothing, so every row takes about one token per step here; what a step costs does not
depend on what it accepts (the whole tree is verified either way).

    python benchmarks/bench_medusa_batched.py --out DIR [--quick]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from bench_medusa_decoding import CONFIGS, DEVICE, NUM_HEADS, _per_unit_ms  # noqa: E402

BATCHES = (1, 2, 4, 8, 16)
# name: (dense widths per head, None for the default tree; tree_tokens, 0 for the whole tree at every batch)
TREES = {"default": (None, 0), "default, cut": (None, None), "9-node": ([2, 1, 1, 1], 0)}
PROMPT_LEN = 128
ACCEPTANCE = (2.0, 2.5, 3.0)


def measure(name: str, cfg: dict, batches: tuple[int, ...]) -> list[dict]:
    import torch

    from liger_models.llama.config import LlamaConfig
    from liger_models.llama.modeling import LigerLlamaForCausalLM
    from liger_models.medusa import MedusaModel
    from liger_models.medusa.tree import TREE_TOKENS, default_medusa_choices, dense_medusa_choices, tree_for_batch

    torch.manual_seed(0)
    base = LigerLlamaForCausalLM.from_config(LlamaConfig.from_hf(dict(cfg)), dtype=torch.bfloat16, device=DEVICE)
    base.eval()
    medusa = MedusaModel.from_base(base, stage=1, num_heads=NUM_HEADS, share_lm_head=True)
    medusa.heads.to(device=DEVICE, dtype=torch.bfloat16)
    rows = []
    with torch.no_grad():
        for batch in batches:
            ids = torch.randint(3, cfg["vocab_size"], (batch, PROMPT_LEN), device=DEVICE)

            def plain(k):
                return base.generate(ids, max_new_tokens=k, eos_token_id=[], cuda_graph=True)

            plain_ms = _per_unit_ms(plain, lambda k: k)
            measured = {}  # tree → its row: a cut that keeps the whole tree is not timed twice
            for tree_name, (widths, tree_tokens) in TREES.items():
                tree_tokens = TREE_TOKENS if tree_tokens is None else tree_tokens
                whole = default_medusa_choices(NUM_HEADS) if widths is None else dense_medusa_choices(widths)
                choices = tree_for_batch(whole, batch, tree_tokens)
                if tuple(choices) in measured:
                    rows.append({**measured[tuple(choices)], "tree": tree_name})
                    print(table(rows[-1:], header=False), flush=True)
                    continue

                def tree(k, stats=False):
                    return medusa.generate(ids, k, eos_token_id=[], cuda_graph=True, return_stats=stats,
                                           medusa_choices=choices, tree_tokens=0)  # cut (or not) above

                def steps(k):
                    per_row = tree(k, True)[1]
                    return max(len(s) for s in per_row) if batch > 1 else len(per_row)

                medusa_ms = _per_unit_ms(tree, steps)
                rows.append(dict(config=name, batch=batch, tree=tree_name, nodes=len(choices) + 1,
                                 prompt_len=PROMPT_LEN, plain_ms_per_step=plain_ms, medusa_ms_per_step=medusa_ms,
                                 break_even_tokens_per_step=medusa_ms / plain_ms,
                                 speedup_at={str(a): a * plain_ms / medusa_ms for a in ACCEPTANCE}))
                measured[tuple(choices)] = rows[-1]
                print(table(rows[-1:], header=len(rows) == 1), flush=True)
    return rows


def table(rows: list[dict], header: bool = True) -> str:
    lines = ["| config | batch | tree | nodes | plain ms/step | medusa ms/step | break-even tok/row/step | "
             + " | ".join(f"speedup @{a}" for a in ACCEPTANCE) + " |",
             "|" + "---|" * (7 + len(ACCEPTANCE))] if header else []
    for r in rows:
        lines.append(f"| {r['config']} | {r['batch']} | {r['tree']} | {r['nodes']} | {r['plain_ms_per_step']:.2f} | "
                     f"{r['medusa_ms_per_step']:.2f} | "
                     f"{r['break_even_tokens_per_step']:.2f} | "
                     + " | ".join(f"{r['speedup_at'][str(a)]:.2f}×" for a in ACCEPTANCE) + " |")
    return "\n".join(lines)


def main() -> None:
    args = harness.parse_args(__doc__.splitlines()[0])
    tuned = harness.apply_tunables()
    names = ["llama-3.2-1b"] if args.quick else list(CONFIGS)
    batches = BATCHES[:3] if args.quick else BATCHES
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for name in names:  # the JSON is rewritten after each config: a run cut short keeps what it measured
        rows += measure(name, CONFIGS[name], batches)
        with open(os.path.join(args.out, "bench_medusa_batched.json"), "w") as f:
            meta = dict(num_heads=NUM_HEADS, prompt_len=PROMPT_LEN, tuned=tuned)
            json.dump({"env": harness.environment(), "meta": meta, "results": rows}, f, indent=1)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
