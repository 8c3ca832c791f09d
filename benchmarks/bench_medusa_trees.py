"""Medusa trees fitted to trained heads (`liger-models calibrate-tree`) against the default tree: tokens per
base-model forward and wall time per new token, greedy decoding, batch 1.

Random heads accept nothing worth fitting, and a machine without network access has no trained Medusa heads to
download, so this trains its own: `liger-models demo` (a small Llama pre-trained on tiny-Shakespeare, three stage-1
heads), or takes `--heads DIR` (any trained heads whose config names their base). The held-out text is split in two:
trees are fitted on greedy continuations of prompts from the first half and measured on prompts from the second, so
no tree is scored on the text it was fitted to.

Per tree (the default one, then fitted trees of SIZES choices): every measurement prompt decoded for NEW_TOKENS
greedy tokens (no stop ids; CUDA graphs on CUDA), after one untimed warm-up call per tree. Reported: tokens per
forward (new tokens ÷ steps; "expected": the same walked over the fitting paths), ms per new token (summed wall
time ÷ summed tokens, each call CUDA-synchronised, graph capture included as in a user's call), and the speed-up
over plain greedy decoding of the same prompts timed the same way. Every Medusa output is checked token for token
against plain greedy decoding: the prompts decoded identically, and the share of tokens before the first difference
(in bf16 a near-tied argmax may flip between the graphed tree and the plain step, so a difference is reported, not
fatal).

    python benchmarks/bench_medusa_trees.py --out DIR [--quick] [--heads DIR --data held_out.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = (8, 16, 32, 63, 96)
NEW_TOKENS = 96
PROMPTS = 12
PROMPT_TOKENS = 48


def _halves(text_file: Path, out: Path) -> tuple[Path, Path]:
    text = text_file.read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, len(text) // 2) + 1 or len(text) // 2
    first, second = out / "fit.txt", out / "measure.txt"
    first.write_text(text[:cut], encoding="utf-8")
    second.write_text(text[cut:], encoding="utf-8")
    return first, second


def _trained_heads(args, out: Path, device: torch.device) -> tuple[Path, Path]:
    """(heads directory, held-out text) from --heads/--data or a fresh demo run."""
    if args.heads is not None:
        return Path(args.heads), Path(args.data)
    from liger_models.cli import build_parser
    from liger_models.recipes import run_demo

    demo = out / "demo"
    argv = ["demo", "--output-dir", str(demo), "--device", device.type] + (["--quick"] if args.quick else [])
    result = run_demo(build_parser().parse_args(argv))
    return Path(result["heads_dir"]), demo / "data" / "eval.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="the quick demo, fewer prompts and tokens (CPU check)")
    parser.add_argument("--heads", default=None, help="trained heads (default: train the demo's)")
    parser.add_argument("--data", default=None, help="with --heads: held-out text like what they will decode")
    args = parser.parse_args()
    if (args.heads is None) != (args.data is None):
        parser.error("--heads and --data go together")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads_dir, held_out = _trained_heads(args, out, device)

    from liger_models.recipes.decoding import calibration_prompts, timed_call
    from liger_models.hub import load_tokenizer
    from liger_models.medusa import MedusaModel
    from liger_models.medusa.calibrate import BATCHES, rank_paths  # the batch sizes whose cut trees are scored
    from liger_models.medusa.tree import (TREE_TOKENS, default_medusa_choices, tree_for_batch, tree_from_rank_paths,
                                         walk_tokens_per_step)
    from liger_models.train.data import read_special_tokens

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    medusa = MedusaModel.from_pretrained(str(heads_dir), dtype=dtype, device=device).eval()
    base, heads = medusa.base, medusa.heads
    model_dir = Path(medusa.config.base_model_name_or_path)
    tokenizer = load_tokenizer(model_dir)
    special = read_special_tokens(tokenizer, model_dir)
    fit_file, measure_file = _halves(held_out, out)
    count, new_tokens = (4, 32) if args.quick else (PROMPTS, NEW_TOKENS)
    graph = device.type == "cuda"

    def prompts_of(path: Path) -> list[torch.Tensor]:
        ids = calibration_prompts([path], tokenizer, special, count=count, prompt_tokens=PROMPT_TOKENS)
        return [torch.tensor(p, device=device) for p in ids]

    def greedy(prompt: torch.Tensor) -> torch.Tensor:
        return base.generate(prompt[None], new_tokens, do_sample=False, eos_token_id=[], cuda_graph=graph)[0]

    fit_prompts, measure_prompts = prompts_of(fit_file), prompts_of(measure_file)
    per_sequence = [rank_paths(base, heads, greedy(p), len(p)).cpu() for p in fit_prompts]
    paths = torch.cat(per_sequence)
    trees = {"default": default_medusa_choices(heads.num_heads)}
    trees.update({f"fitted-{size}": tree_from_rank_paths(paths, size) for size in SIZES})

    greedy(measure_prompts[0])  # warm-up: kernels compiled, one capture
    plain = [timed_call(lambda: greedy(p), device) for p in measure_prompts]
    plain_ms = 1e3 * sum(s for _, s in plain) / (len(measure_prompts) * new_tokens)
    rows = []
    for name, tree in trees.items():
        def run(prompt: torch.Tensor):
            return medusa.generate(prompt[None], new_tokens, medusa_choices=tree, eos_token_id=[],
                                   return_stats=True, cuda_graph=graph)

        run(measure_prompts[0])  # warm-up
        calls = [timed_call(lambda: run(p), device) for p in measure_prompts]
        tokens = sum(sum(steps) for (_, steps), _ in calls)
        steps = sum(len(steps) for (_, steps), _ in calls)
        ms = 1e3 * sum(s for _, s in calls) / tokens
        # new tokens each Medusa decoding shares with plain greedy's before the first difference
        same = [_agreeing(o[0], ref) - len(p) for ((o, _), _), (ref, _), p in zip(calls, plain, measure_prompts)]
        whole = sum(n == new_tokens for n in same)
        rows.append(dict(tree=name, nodes=len(tree) + 1, tokens_per_forward=tokens / steps,
                         expected_on_fit_paths=walk_tokens_per_step(tree, per_sequence), ms_per_token=ms,
                         speedup_vs_plain=plain_ms / ms, identical=whole == len(plain), identical_prompts=whole,
                         agreeing_prefix=sum(same) / (len(same) * new_tokens)))
    # What each row of a batch would accept under the cut decoding makes for that batch (`tree_for_batch`): the
    # walk over the fitting paths, which tracks the measured tokens per forward within a few per cent.
    cuts = [dict(tree=name, batch=batch, nodes=len(cut) + 1,
                 expected_on_fit_paths=walk_tokens_per_step(cut, per_sequence))
            for name in ("default", f"fitted-{max(SIZES)}") for batch in BATCHES
            for cut in [tree_for_batch(trees[name], batch)]]
    result = dict(device=torch.cuda.get_device_name(device) if graph else "cpu", torch=torch.__version__,
                  dtype=str(dtype), heads=str(heads_dir), fit_positions=len(paths), prompts=len(measure_prompts),
                  new_tokens=new_tokens, plain_ms_per_token=plain_ms, rows=rows, cut_for_batch=cuts)
    (out / "bench_medusa_trees.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nplain greedy: {plain_ms:.3f} ms per token ({result['device']}, {dtype}, {len(paths)} fit positions)")
    print(f"{'tree':>12} {'nodes':>5} {'tok/fwd':>8} {'expected':>8} {'ms/tok':>8} {'speedup':>8} "
          "identical prompts, agreeing prefix")
    for r in rows:
        print(f"{r['tree']:>12} {r['nodes']:>5} {r['tokens_per_forward']:>8.2f} {r['expected_on_fit_paths']:>8.2f} "
              f"{r['ms_per_token']:>8.3f} {r['speedup_vs_plain']:>7.2f}× {r['identical_prompts']}/{len(plain)}, "
              f"{100 * r['agreeing_prefix']:.1f}%")
    print(f"\ncut for a batch (tree_tokens {TREE_TOKENS}): expected tokens per forward per row")
    for r in cuts:
        print(f"{r['tree']:>12} batch {r['batch']:>2}: {r['nodes']:>3} nodes, {r['expected_on_fit_paths']:.2f}")


def _agreeing(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    """How many leading tokens two decodings share (the prompt's included): once one near-tied argmax flips, the
    rest of the continuation differs for that reason alone."""
    differ = (tokens != reference).nonzero()
    return int(differ[0]) if len(differ) else len(reference)


if __name__ == "__main__":
    main()
