"""Which tensors one training forward saves for backward, per decoder layer, in bytes per token.

Runs on the CPU: TRITON_INTERPRET=1 is set before anything imports Triton, so every kernel goes through the same
autograd.Function (and saves the same tensors) as on CUDA; only the arithmetic runs in Triton's interpreter.
Every tensor handed to autograd's saved-tensor machinery is seen by a ``saved_tensors_hooks`` pack hook; tensors
that share storage are counted once (by the storage's size), parameters are listed apart, and each saved tensor is
attributed to the module that was running (forward pre/post hooks) and the innermost call site in this project.

    python benchmarks/tools/saved_activations.py [--config llama-3.2-1b] [--layers 2] [--batch 1] [--seq 256]

Prints one table per decoder layer (bytes/token by producer) and the whole model's total; with the bench_e2e shape
it also extrapolates to the full model (bytes/token/layer × batch·seq × layers of the real config).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton import: the kernels' Functions, not references

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_e2e import CONFIGS  # noqa: E402


def _call_site() -> str:
    """Innermost frame in liger_models/ (outside this script): 'file.py:line fn'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/liger_models/" in path and "saved_activations" not in path:
            return f"{Path(path).name}:{frame.lineno} {frame.name}"
    return "?"


def collect(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[list[dict], set[int]]:
    """Forward + loss with a pack hook; returns one record per distinct saved storage and the parameter storages."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    names = {m: n for n, m in model.named_modules()}
    # Containers only: the fused paths call a hooked projection or norm instead of reading its weight (a hook must
    # run: modules/linear.py is_plain_linear, attention's q/k-norm check), so hooking leaves would measure the
    # unfused step.
    hooked = [m for m in model.modules() if next(m.children(), None) is not None]
    handles = [m.register_forward_pre_hook(lambda m, a: stack.append(names[m])) for m in hooked]
    handles += [m.register_forward_hook(lambda m, a, o: None if stack.pop() else None) for m in hooked]
    records: dict[int, dict] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        site = f"{stack[-1] if stack else '<top>'} | {_call_site()}"
        if key not in records:
            records[key] = dict(site=site, shape=tuple(t.shape), dtype=t.dtype, bytes=t.untyped_storage().nbytes(),
                                param=key in param_storages, also=set())
        elif records[key]["site"] != site:
            records[key]["also"].add(site)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids, labels=labels).loss
    for h in handles:
        h.remove()
    del loss
    return list(records.values()), param_storages


def report(records: list[dict], tokens: int, full_layers: int, full_tokens: int) -> None:
    acts = [r for r in records if not r["param"]]
    per_layer: dict[str, list[dict]] = defaultdict(list)
    for r in acts:
        m = re.match(r"model\.layers\.(\d+)", r["site"])
        per_layer[f"layer {m.group(1)}" if m else "outside layers"].append(r)
    for group in sorted(per_layer):
        rows = sorted(per_layer[group], key=lambda r: -r["bytes"])
        total = sum(r["bytes"] for r in rows)
        print(f"\n### {group}: {total / tokens:,.0f} bytes/token\n")
        print("| bytes/token | shape | dtype | saved by (module | call site) | also saved by |")
        print("|---:|---|---|---|---|")
        for r in rows:
            also = "; ".join(sorted(r["also"])) or ""
            print(f"| {r['bytes'] / tokens:,.1f} | {list(r['shape'])} | {str(r['dtype']).removeprefix('torch.')} "
                  f"| {r['site']} | {also} |")
    layer_keys = [k for k in per_layer if k.startswith("layer ")]
    steady = max(layer_keys, key=lambda k: int(k.split()[1])) if layer_keys else None
    total = sum(r["bytes"] for r in acts)
    print(f"\nall saved activations: {total / 2**20:.2f} MiB for {tokens} tokens "
          f"(+ {sum(r['bytes'] for r in records if r['param']) / 2**20:.1f} MiB of parameters, not counted)")
    if steady:
        per_tok = sum(r["bytes"] for r in per_layer[steady]) / tokens
        print(f"steady-state layer ({steady}): {per_tok:,.0f} bytes/token/layer → at {full_tokens} tokens × "
              f"{full_layers} layers: {per_tok * full_tokens * full_layers / 2**30:.2f} GiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="llama-3.2-1b", choices=sorted(CONFIGS))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (the loss head only)")
    args = p.parse_args()
    from liger_models.auto import model_class

    cfg, full_batch, full_seq = CONFIGS[args.config]
    cfg = dict(cfg, num_hidden_layers=args.layers)
    full_layers = CONFIGS[args.config][0]["num_hidden_layers"]
    if args.vocab:
        cfg["vocab_size"] = args.vocab
    cls = model_class(cfg["model_type"])
    torch.manual_seed(0)
    model = cls.from_config(cls.config_class.from_hf(cfg), dtype=torch.bfloat16).train()
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq))
    records, _ = collect(model, ids, ids.clone())
    print(f"{args.config}: {args.layers} layers, batch {args.batch}×{args.seq}, bf16, TRITON_INTERPRET="
          f"{os.environ.get('TRITON_INTERPRET')}")
    report(records, args.batch * args.seq, full_layers, full_batch * full_seq)


if __name__ == "__main__":
    main()
