"""Linear + cross-entropy (the LM head's loss), forward + backward w.r.t. hidden and weight: this project vs eager
PyTorch (HF: logits = h·Wᵀ in bf16, upcast, F.cross_entropy), torch.compile of that, liger-kernel 0.8.5
(LigerFusedLinearCrossEntropyLoss) and Apple's cut-cross-entropy 25.1.1 (linear_cross_entropy, default CCE impl).

bf16 hidden (N, H) and weight (V, H), both leaves requiring grad; mean reduction, 1/16 of the labels ignored.
Time: median of triton's do_bench. Memory (the table's MiB): peak allocated during forward + backward above the
inputs AND the gradient outputs (N·H + V·H bf16), as linear-CE's memory target counts it; the raw peak and this
project's fp32 V×H dW accumulator (allowed on top of the 256 MiB budget) are in Result.extra. Floor: 6·N·H·V FLOP
at the bf16 matmul rate measured in the same run (8192³); Result.extra has each provider's effective TFLOP/s and its
fraction of that rate. Two distributions: "random" (N(0,1) hidden, weight scaled to logits of std ≈2, uniform
labels) and "peaked" (a shared direction gives each token a Zipf-like logit bias of up to +20, labels sampled from the
softmax itself; CCE's gradient filtering only pays here). At the headline shapes CCE also runs with its filter off
(`cut-cross-entropy exact`, filter_eps=None: every block's work, though its dE / dC still accumulate in bf16 —
25.1.1 has no fp32-accumulating variant), and this project also runs
without grad_W's storage as the logits scratch (token chunks from a 256 MiB or a 1 GiB budget instead):
`liger-models budget256` / `liger-models budget1024`; under a 512 MiB scratch cap (`liger-models cap512`:
max_scratch_bytes, the fp32 accumulator becoming grad_W in place; also at the Gemma-2B step's BT16384 H2048
V256000); with overlap_ce flipped (`liger-models overlap`: the CE pass of each chunk on a side stream, overlapping
the previous chunk's gradient GEMMs); and with single_chunk_in_accumulator flipped where N ≤ 2H (`liger-models
chunked`: the default is one chunk there).
The Gemma-2-9B step's loss (BT8192 H3584 V256000) runs with its final-logit soft-cap of 30 in every provider
(`liger-models softcap30`: the cap inside the row kernel).
`liger-models filtered` runs every case with grad_filter_eps=2⁻¹², cut-cross-entropy's default threshold for bf16
(opt-in: each token chunk's backward GEMMs over the vocabulary columns whose per-token gradient reaches it;
liger_models/kernels/ops/_grad_filter.py). At the headline shapes both filtered providers' dh and dW are compared with this
project's exact ones (Result.extra["vs_exact"]: relative L2 errors, and the share of the lm_head's rows left with
no gradient).

    python benchmarks/bench_fused_linear_cross_entropy.py [--quick] [--out DIR] [--providers liger-models,...]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from bench_cross_entropy import sample_labels, zipf_bias
from harness import Result, matmul_tflops, parse_args, run_case, save, table

MiB = 1 << 20
HEADLINE = [(8192, 4096, 128256), (8192, 2048, 256000), (16384, 2048, 128256)]
GEMMA_STEP = (16384, 2048, 256000)  # the Gemma-2B e2e step's loss (bench_e2e): where the scratch cap is weighed
# The Gemma-2-9B e2e step's loss (bench_e2e gemma2-9b-w8l, 4×2048) with its final-logit soft-cap of 30, every
# provider capping: this project inside the row kernel, eager / torch.compile as HF (c·tanh(z/c) on the bf16
# logits, then the upcast), liger-kernel and cut-cross-entropy through their softcap arguments.
GEMMA2_STEP, GEMMA2_SOFTCAP = (8192, 3584, 256000), 30.0
SWEEP = [(2048, 4096, 128256), (32768, 2048, 128256), (8192, 8192, 128256), (8192, 4096, 32000),
         (8192, 4096, 152064), (32768, 4096, 256000), (16384, 8192, 152064)]
EAGER_MAX_ELEMENTS = 3 << 30  # eager holds bf16 + fp32 logits and their grads: ≈12 B per logit
IGNORE = -100


def make_inputs(n: int, hdim: int, vocab: int, kind: str):
    hidden = torch.randn(n, hdim, device="cuda")
    weight = torch.randn(vocab, hdim, device="cuda") * (2 / math.sqrt(hdim))
    if kind == "peaked":
        # logit_ij = g_j·z_i + bias_j: a Zipf-like frequency bias (up to +20) carried by one shared direction u
        u = torch.nn.functional.normalize(torch.randn(hdim, device="cuda"), dim=0)
        hidden = hidden - (hidden @ u)[:, None] * u + 4.0 * u
        weight = weight / 2 + zipf_bias(vocab, 20.0)[:, None] / 4.0 * u
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    if kind == "random":
        labels = torch.randint(0, vocab, (n,), device="cuda")
    else:
        labels = sample_labels(lambda s, e: hidden[s:e] @ weight.t(), n)
    labels[::16] = IGNORE
    return hidden.requires_grad_(), weight.requires_grad_(), labels


FILTER_EPS = 2.0**-12  # cut-cross-entropy's filter_eps="auto" for bf16 (bf16 eps / 32)


def cce_loss(h, w, y, filter_eps="auto"):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y, ignore_index=IGNORE, reduction="mean", filter_eps=filter_eps)


def filtered_loss(h, w, y):
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(h, w, y, grad_filter_eps=FILTER_EPS)


def vs_exact(hidden, weight, labels) -> dict:
    """dh and dW of the filtered providers against this project's exact (fp32-accumulated) ones."""
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    def grads(fn):
        return [g.double() for g in torch.autograd.grad(fn(hidden, weight, labels), (hidden, weight))]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    dh, dw = grads(fused_linear_cross_entropy)
    out = {}
    for name, fn in (("liger-models filtered", filtered_loss), ("cut-cross-entropy", cce_loss)):
        try:
            fh, fw = grads(fn)
        except Exception as e:  # noqa: BLE001 (a peer that is not installed)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[name] = {"dh_rel_err": rel(fh, dh), "dw_rel_err": rel(fw, dw),
                     "rows_without_grad": ((fw == 0).all(1) & (dw != 0).any(1)).double().mean().item()}
        del fh, fw
    return out


def softcapped_providers(hidden, weight, labels, cap: float) -> dict:
    """Every provider with a final-logit soft-cap of ``cap`` (GEMMA2_STEP)."""
    from liger_models.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

    def step(fn):
        return lambda: torch.autograd.grad(fn(hidden, weight, labels), (hidden, weight))

    def reference(h, w, y):  # HF's Gemma2ForCausalLM + ForCausalLMLoss: cap the bf16 logits, upcast, cross-entropy
        logits = F.linear(h, w)
        return F.cross_entropy((torch.tanh(logits / cap) * cap).float(), y, ignore_index=IGNORE)

    def liger(h, w, y):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, softcap=cap)(w, h, y)

    def cce(h, w, y):
        from cut_cross_entropy import linear_cross_entropy

        return linear_cross_entropy(h, w, y, ignore_index=IGNORE, reduction="mean", softcap=cap)

    out = {f"liger-models softcap{cap:g}": step(lambda h, w, y: fused_linear_cross_entropy(h, w, y, softcap=cap))}
    if hidden.shape[0] * weight.shape[0] <= EAGER_MAX_ELEMENTS:
        out["eager"] = step(reference)
        out["torch.compile"] = step(torch.compile(reference, dynamic=False))
    out["liger-kernel"] = step(liger)
    out["cut-cross-entropy"] = step(cce)
    return out


def providers(hidden, weight, labels, variants: bool) -> dict:
    import liger_models.kernels.ops.fused_linear_cross_entropy as flce
    from liger_models.kernels._tuning import tuned

    n, hdim, vocab = hidden.shape[0], hidden.shape[1], weight.shape[0]

    def step(fn):
        return lambda: torch.autograd.grad(fn(hidden, weight, labels), (hidden, weight))

    def ours(**settings):  # the chunk loop's settings (flce.TUNING fields) for this provider
        def fn(h, w, y):
            with tuned(flce, **settings):
                return flce.fused_linear_cross_entropy(h, w, y)

        return step(fn)

    def reference(h, w, y):  # HF's path (ForCausalLMLoss): bf16 logits, upcast, F.cross_entropy
        return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=IGNORE)

    def liger(h, w, y):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)(w, h, y)

    out = {"liger-models": ours(), "liger-models filtered": step(filtered_loss)}
    if variants:
        out["liger-models budget256"] = ours(grad_weight_as_scratch=False, logits_budget_bytes=256 * MiB)
        out["liger-models budget1024"] = ours(grad_weight_as_scratch=False, logits_budget_bytes=1024 * MiB)
        # a capped scratch: the fp32 accumulator becomes grad_W in place (peak 4·V·H + 512 MiB instead of 6·V·H)
        out["liger-models cap512"] = ours(max_scratch_bytes=512 * MiB)
        # the CE pass of each chunk on a side stream, overlapping the previous chunk's gradient GEMMs
        out["liger-models overlap"] = ours(overlap_ce=not flce.TUNING.overlap_ce)
        if n <= 2 * hdim:  # N ≤ 2H: one chunk in the fp32 accumulator's bytes, dW straight into grad_W
            flipped = "chunked" if flce.TUNING.single_chunk_in_accumulator else "single"
            single = not flce.TUNING.single_chunk_in_accumulator
            out[f"liger-models {flipped}"] = ours(single_chunk_in_accumulator=single)
    if n * vocab <= EAGER_MAX_ELEMENTS:
        out["eager"] = step(reference)
        out["torch.compile"] = step(torch.compile(reference, dynamic=False))
    out["liger-kernel"] = step(liger)
    out["cut-cross-entropy"] = step(cce_loss)
    if variants:  # CCE without its gradient filter: every dlogits block computed, the work an exact dW needs
        out["cut-cross-entropy exact"] = step(lambda h, w, y: cce_loss(h, w, y, filter_eps=None))
    return out


def time_case(label: str, fns: dict, flop: float, grad_mib: float, scratch_mib: float, rate: float,
              extra: dict, wanted: set[str]) -> list[Result]:
    results = run_case(label, fns, {**extra, "flop": flop}, wanted)
    for r in results:
        if r.ms:
            r.extra["peak_raw_mib"] = r.peak_mib
            r.peak_mib -= grad_mib  # the memory target: above the inputs and the gradient outputs
            r.extra["tflops"] = flop / (r.ms * 1e-3) / 1e12
            r.extra["frac_matmul"] = r.extra["tflops"] / rate
            if r.provider.startswith("liger-models"):
                r.extra["peak_beyond_fp32_dw_scratch_mib"] = r.peak_mib - scratch_mib
    torch.cuda.empty_cache()
    return results


def main() -> None:
    args = parse_args(__doc__)
    wanted = set(filter(None, args.providers.split(",")))
    rate = matmul_tflops()
    cases = [(n, h, v, kind, True) for n, h, v in HEADLINE for kind in ("random", "peaked")]
    cases.append((*GEMMA_STEP, "random", True))
    if not args.quick:
        cases += [(n, h, v, "random", False) for n, h, v in SWEEP]
    results = []
    accuracy = {}
    for n, hdim, vocab, kind, variants in cases:
        flop = 6.0 * n * hdim * vocab
        case = f"linear-CE BT{n} H{hdim} V{vocab} {kind}"
        inputs = make_inputs(n, hdim, vocab, kind)
        if (n, hdim, vocab) in HEADLINE:
            accuracy[case] = vs_exact(*inputs)
        results += time_case(case, providers(*inputs, variants), flop, (n + vocab) * hdim * 2 / MiB,
                             vocab * hdim * 4 / MiB, rate, {"bt": n, "hidden": hdim, "vocab": vocab, "logits": kind},
                             wanted)
        del inputs
    n, hdim, vocab = GEMMA2_STEP
    case = f"linear-CE BT{n} H{hdim} V{vocab} random softcap{GEMMA2_SOFTCAP:g}"
    inputs = make_inputs(n, hdim, vocab, "random")
    results += time_case(case, softcapped_providers(*inputs, GEMMA2_SOFTCAP), 6.0 * n * hdim * vocab,
                         (n + vocab) * hdim * 2 / MiB, vocab * hdim * 4 / MiB, rate,
                         {"bt": n, "hidden": hdim, "vocab": vocab, "logits": "random", "softcap": GEMMA2_SOFTCAP},
                         wanted)
    del inputs
    for r in results:
        if r.provider in accuracy.get(r.case, {}):
            r.extra["vs_exact"] = accuracy[r.case][r.provider]
    floors = {r.case: r.extra["flop"] / (rate * 1e12) * 1e3 for r in results}
    save("fused_linear_cross_entropy", args.out, results,
         {"matmul_tflops": rate, "floor_ms": floors, "note": "bf16, mean, 1/16 ignored; MiB = peak above inputs "
          "and gradient outputs; floor = 6·N·H·V / measured 8192³ bf16 matmul rate"})
    print(f"bf16 matmul rate (8192³) {rate:.0f} TFLOP/s; effective TFLOP/s, fraction of it, MiB beyond gradients:")
    for r in results:
        status = (f"{r.extra['tflops']:6.0f} TFLOP/s  {r.extra['frac_matmul']:.2f}  {r.peak_mib:8.0f} MiB"
                  if r.ms else r.error)
        print(f"  {r.case:>40}  {r.provider:<26} {status}")
    print("filtered gradients against the exact ones (rel. L2 error of dh, dW; lm_head rows left without gradient):")
    for case, by_provider in accuracy.items():
        for name, e in by_provider.items():
            cells = e.get("error") or (f"dh {e['dh_rel_err']:.2e}  dW {e['dw_rel_err']:.2e}  "
                                       f"rows {100 * e['rows_without_grad']:.1f}%")
            print(f"  {case:>40}  {name:<24} {cells}")
    print(table(results, floors))


if __name__ == "__main__":
    main()
