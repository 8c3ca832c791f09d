"""Cross-entropy on materialised bf16 logits, forward + backward: this project vs eager PyTorch (HF's numerics:
upcast to fp32, F.cross_entropy), torch.compile of that, and liger-kernel 0.8.5 (LigerCrossEntropyLoss).

Mean reduction, ignore_index=-100 on 1/16 of the rows. The logits are a leaf tensor; this project runs with
inplace_grad=True (liger-kernel also overwrites its input with the gradient), so neither holds a second N×V
buffer; each in-place provider works on its own copy (from its second call on it sees its previous gradient:
the kernels are memory-bound, values do not change their time). Bytes (the floor): read the logits once and
write the gradient once, 4·N·V B; floor = bytes / measured copy bandwidth. Two logit distributions: "random"
N(0, 2²) with uniform labels, and "peaked" (a Zipf-like per-token bias of up to +20, labels sampled from the
softmax itself, so the loss is its entropy as for a trained LM); memory-bound, so they should time alike.
"liger-models kernel only" times the fused row kernel alone (no label check, no autograd): the difference to
"liger-models" is what the call adds (the label check, the gradient's scale, autograd, and any host time the GPU
waits for).
At the headline shapes and three sweep shapes, variants of the row kernel are timed too (`liger-models bBLOCKwWARPS
...`, see VARIANTS): the fastest sets liger_models/kernels/ops/_ce_core.py's tunables (shared with fused_linear_cross_entropy).

    python benchmarks/bench_cross_entropy.py [--quick] [--out DIR] [--providers liger-models,eager,...]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from _bandwidth import report, time_case
from harness import copy_bandwidth_gbs, parse_args

HEADLINE = [(8192, 128256), (4096, 256000)]
SWEEP = [(2048, 128256), (16384, 32000), (16384, 152064), (16384, 256000), (32768, 128256), (32768, 256000)]
# Settings of liger_models/kernels/ops/_ce_core.py timed besides the default: bBLOCKwWARPS, "fwd" = pass 2 in forward order, "nohint"
# = no eviction hints, "lanes" / "bsums" = pass 1 with per-thread / per-block partial sums, "keepN" = pass 1's loads
# evict_last only in the tail of a row that N% of L2 holds for every resident row, "rN" = ptxas capped at N registers
# per thread on rows up to 128K wide (the default: 32), "nocap" = no cap, "capall" = the cap at every width,
# "nosplit" = one program per row at any width, "splitNk" = wide rows split over programs of at most N K columns.
# (A one-read split-row kernel, persistent grids, partial-statistics + finishing split kernels and 32K-64K leading
# columns held in registers between the passes were timed here too and lost: BENCHMARKS.md, "Cross-entropy".)
def _variant(block: int, warps: int, flags: str = "") -> tuple[str, dict]:
    words = flags.split()
    name = f"b{block}w{warps}" + "".join(f" {w}" for w in words)
    settings = dict(block_v=block, num_warps=warps, reverse_pass2="fwd" not in words,
                    eviction_hints="nohint" not in words)
    if "lanes" in words or "bsums" in words:
        settings.update(lane_sums="lanes" in words, lane_sums_min_rows=0)
    settings.update({"keep_l2_share": int(w[4:]) / 100 for w in words if w.startswith("keep")})
    settings.update({"max_registers": int(w[1:]) for w in words if w[0] == "r" and w[1:].isdigit()})
    settings.update({"max_registers": None for w in words if w == "nocap"})
    settings.update({"max_registers_cols": 1 << 30 for w in words if w == "capall"})
    settings.update({"split_cols": None for w in words if w == "nosplit"})
    settings.update({"prefetch_pass2": False for w in words if w == "noprefetch"})
    settings.update({"split_cols": int(w[5:-1]) << 10 for w in words if w.startswith("split") and w[-1] == "k"})
    return name, settings


VARIANTS = dict(_variant(*v) for v in [
    (16384, 32, "nosplit"), (16384, 32, "noprefetch"), (16384, 32, "keep90"), (8192, 16, ""),
])
# Sweep cases that time the variants too: few rows, wide rows, and the two where liger-kernel led by most.
SWEEP_WITH_VARIANTS = {(2048, 128256), (16384, 152064), (32768, 128256), (16384, 256000)}
EAGER_MAX_ELEMENTS = 3 << 30  # eager holds bf16 + fp32 logits + fp32 and bf16 grads: ≈12 B per logit
IGNORE = -100


def zipf_bias(vocab: int, top: float) -> torch.Tensor:
    """Per-token logit bias top·(1 − log(rank)/log V), ranks scattered over the ids (a word-frequency prior)."""
    ranks = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float32)
    bias = torch.empty(vocab, device="cuda")
    bias[torch.randperm(vocab, device="cuda")] = top * (1 - torch.log(ranks) / math.log(vocab))
    return bias


def sample_labels(logits_of_rows, n: int, rows_per_step: int = 1024) -> torch.Tensor:
    """Labels drawn from softmax(logits) row by row (so the loss is the distribution's entropy, as for a trained
    LM); logits_of_rows(start, end) gives the bf16 logits of rows [start, end)."""
    out = [torch.multinomial(torch.softmax(logits_of_rows(s, min(n, s + rows_per_step)).float(), -1), 1)[:, 0]
           for s in range(0, n, rows_per_step)]
    return torch.cat(out)


def make_inputs(n: int, vocab: int, kind: str):
    """bf16 leaf logits (N, V) and int64 labels with every 16th row ignored."""
    if kind == "random":
        logits = 2 * torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, vocab, (n,), device="cuda")
    else:
        logits = (torch.randn(n, vocab, device="cuda") + zipf_bias(vocab, 20.0)).to(torch.bfloat16)
        labels = sample_labels(lambda s, e: logits[s:e], n)
    labels[::16] = IGNORE
    return logits.requires_grad_(), labels


def providers(n: int, vocab: int, kind: str, variants: bool) -> dict:
    from liger_models.kernels.ops import _ce_core, _labels
    from liger_models.kernels._tuning import tuned
    from liger_models.kernels.ops.cross_entropy import cross_entropy

    logits, labels = make_inputs(n, vocab, kind)
    def reference(x, y):  # HF ForCausalLMLoss: logits.float(), F.cross_entropy(ignore_index=-100)
        return F.cross_entropy(x.float(), y, ignore_index=IGNORE)

    def step(fn, in_place=False):
        # An in-place provider gets its own copy (its gradient replaces the logits from the first call on).
        x = logits.detach().clone().requires_grad_() if in_place else logits
        return lambda: torch.autograd.grad(fn(x, labels), x)

    def ours(settings):
        def fn(x, y):  # the whole kernel runs in the forward (gradients are computed there)
            with tuned(_ce_core, **settings):
                return cross_entropy(x, y, inplace_grad=True)

        return step(fn, in_place=True)

    def kernel_only():
        # The fused row kernel alone (one launch on a private copy, labels checked and mean's scale computed once):
        # against "liger-models" it separates kernel time from what the call adds (label check, autograd, host).
        x, checked = logits.detach().clone(), _labels.LabelCheck(labels, vocab, IGNORE, "mean")
        checked.wait()
        scale, flag = checked.scale, checked.flag
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        lse, q = torch.empty_like(loss), torch.empty_like(loss)
        return lambda: _ce_core.ce_rows(x, labels, grad=x, loss=loss, lse=lse, q=q, rank=None, scale=scale,
                                        ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, softcap=None,
                                        label_flag=flag)

    def liger(x, y):
        from liger_kernel.transformers import LigerCrossEntropyLoss

        return LigerCrossEntropyLoss(ignore_index=IGNORE)(x, y)

    out = {"liger-models": ours({}), "liger-models kernel only": kernel_only()}
    if variants:
        out.update({f"liger-models {name}": ours(settings) for name, settings in VARIANTS.items()
                    if any(getattr(_ce_core.TUNING, k) != v for k, v in settings.items())})
    if n * vocab <= EAGER_MAX_ELEMENTS:
        out["eager"] = step(reference)
        out["torch.compile"] = step(torch.compile(reference, dynamic=False))
    out["liger-kernel"] = step(liger, in_place=True)
    return out


def main() -> None:
    args = parse_args(__doc__)
    wanted = set(filter(None, args.providers.split(",")))
    copy_gbs = copy_bandwidth_gbs()
    cases = [(n, v, kind, True) for n, v in HEADLINE for kind in ("random", "peaked")]
    if not args.quick:
        cases += [(n, v, "random", (n, v) in SWEEP_WITH_VARIANTS) for n, v in SWEEP]
    results = []
    for n, vocab, kind, variants in cases:
        results += time_case(f"CE {n}x{vocab} {kind}", providers(n, vocab, kind, variants), 4 * n * vocab,
                             copy_gbs, {"rows": n, "vocab": vocab, "logits": kind}, wanted)
        torch.cuda.empty_cache()
    report("cross_entropy", args.out, results, copy_gbs,
           "bf16 logits (leaf, overwritten in place by liger-models and liger-kernel), mean reduction, "
           "1/16 ignored; floor = 4·N·V B (read logits + write grad) / copy bandwidth")


if __name__ == "__main__":
    main()
