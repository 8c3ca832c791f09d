"""One mixture-of-experts layer, forward + backward (bf16): this project vs transformers 5.x's experts paths.

Shapes are the MLP slots of Qwen3-30B-A3B (D 2048, 128 experts of 768, top-8, renormalised) and Mixtral-8x7B
(D 4096, 8 experts of 14336, top-2) at 4 × 2048 tokens; router logits random (each layer's routing is what it is).
Providers: "liger-models" is liger_models.modules.moe.SparseMoeBlock as it ships (sorted rows, torch grouped_mm, the
fused gated kernel, a backward that saves only the gate|up output, each token's k rows summed in one pass by
kernels/ops/slot_sum.py, and the experts' activation backward in one pass that also forms the routing weights'
gradient, gated_mlp.gated_backward_scaled); "liger-models-unfused-backward" the same with that activation backward as
its PyTorch passes (scaled copy, gated backward, row dots), and "liger-models-unfused" with the sums as PyTorch's
gather, product and sum as well: what each one-pass kernel is worth;
"hf-grouped_mm" and "hf-eager" are transformers'
Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock with experts_implementation "grouped_mm" (its default) and "eager"
(a Python loop over experts). "gemms-only" is the floor of a grouped_mm layer: its six grouped GEMMs alone, at the
same routing. All run on the same weights. Peak memory is what a forward + backward allocates above
its inputs; time is one forward + backward forming fresh gradients (``step``).

    python benchmarks/bench_moe.py [--quick] [--out DIR] [--providers liger-models,hf-grouped_mm,...]
"""

from __future__ import annotations

import copy

import torch
from harness import parse_args, run_case, save, table

CASES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden=2048, inter=768, experts=128, top_k=8, tokens=8192),
    "mixtral-8x7b": dict(model_type="mixtral", hidden=4096, inter=14336, experts=8, top_k=2, tokens=8192),
}


def _configs(case: dict):
    import transformers

    from liger_models import MixtralConfig, Qwen3MoeConfig

    common = dict(hidden_size=case["hidden"], num_experts_per_tok=case["top_k"], num_hidden_layers=1,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=1024)
    if case["model_type"] == "qwen3_moe":
        fields = dict(common, num_experts=case["experts"], moe_intermediate_size=case["inter"], norm_topk_prob=True)
        return Qwen3MoeConfig(**fields), transformers.Qwen3MoeConfig(**fields)
    fields = dict(common, num_local_experts=case["experts"], intermediate_size=case["inter"])
    return MixtralConfig(**fields), transformers.MixtralConfig(**fields)


def providers(case: dict) -> dict:
    import transformers

    from liger_models.modules.moe import SparseMoeBlock

    ours_cfg, hf_cfg = _configs(case)
    with torch.device("cuda"):
        ours = SparseMoeBlock(ours_cfg).to(torch.bfloat16)
        with torch.no_grad():
            for p in ours.parameters():
                p.normal_(0.0, 0.02)
        blocks = {}
        for impl in ("grouped_mm", "eager"):
            # transformers' experts read config._experts_implementation at every call, not at construction: each
            # block needs a config of its own, or both run whichever was set last.
            hf_cfg = copy.deepcopy(hf_cfg)
            hf_cfg._experts_implementation = impl
            module = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock \
                if case["model_type"] == "mixtral" else transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
            block = module(hf_cfg).to(torch.bfloat16)
            block.load_state_dict({"gate.weight": ours.gate.weight, "experts.gate_up_proj": ours.experts.gate_up_proj,
                                   "experts.down_proj": ours.experts.down_proj})
            blocks[impl] = block
    x = torch.randn(1, case["tokens"], case["hidden"], device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    return {"liger-models": step(ours, x, dy),
            "liger-models-unfused-backward": _unfused(step(ours, x, dy), sums=False),
            "liger-models-unfused": _unfused(step(ours, x, dy)),
            "hf-grouped_mm": step(blocks["grouped_mm"], x, dy),
            "hf-eager": step(blocks["eager"], x, dy), "gemms-only": _gemms_only(ours, x, dy, case["top_k"])}


def step(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """One forward + backward of ``module`` that returns fresh gradients of x and every parameter, as a training
    step after zero_grad(set_to_none=True) forms them. Not ``.backward()``: run after run that adds each gradient into
    the last one's .grad, a read-add-write of the expert stacks' size (2.8 GB at Mixtral's width) that no training step
    without gradient accumulation does and the GEMMs-only floor never did."""
    inputs = [x, *module.parameters()]

    def run():
        return torch.autograd.grad(module(x), inputs, dy)
    return run


def _unfused(run, sums: bool = True):
    """``run`` with the experts' activation backward as its PyTorch passes (gated_mlp.TUNING.fuse_scaled_backward
    off) and, with ``sums``, each token's k rows summed by PyTorch's gather, product and sum (slot_sum.TUNING.fused
    off): the layer without the one-pass kernels it ships with."""
    from liger_models.kernels._tuning import tuned
    from liger_models.kernels.ops import gated_mlp, slot_sum

    def unfused():
        with tuned(slot_sum, fused=not sums), tuned(gated_mlp, fuse_scaled_backward=False):
            return run()
    return unfused


def _gemms_only(block, x: torch.Tensor, dy: torch.Tensor, top_k: int):
    """The layer's six grouped GEMMs alone (gate|up and down forward, both input gradients, both weight gradients) at
    the routing ``block``'s router gives ``x``: what any layer built on torch's grouped GEMM spends at the least, so
    the time a fused path could still save is the layer's time less this."""
    from liger_models.modules.moe import grouped_linear, grouped_weight_grad, route

    with torch.no_grad():
        rows_in = x.detach().reshape(-1, x.shape[-1])
        _, experts = route(block.gate(rows_in), top_k, True, False)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        counts = torch.bincount(flat, minlength=block.num_experts)
        rows = rows_in[order // top_k].contiguous()
        g = dy.detach().reshape(-1, x.shape[-1])[order // top_k].contiguous()
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    n = rows_in.shape[0]

    def linear(a, w):
        return grouped_linear(a, w, counts, expert_of_row, "grouped_mm", n)

    def weight_grad(a, b):
        return grouped_weight_grad(a, b, counts, expert_of_row, "grouped_mm", n)

    act = linear(rows, gate_up)[:, :down.shape[-1]].contiguous()  # the down GEMM's input, made once: no copy is timed

    def run():
        hidden = linear(rows, gate_up)
        linear(act, down)
        linear(g, down.transpose(-2, -1))
        weight_grad(g, act)
        weight_grad(hidden, rows)
        linear(hidden, gate_up.transpose(-2, -1))
    return run


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    wanted = {p for p in args.providers.split(",") if p}
    results = []
    for name, case in CASES.items():
        results += run_case(name, providers(case), extra=dict(case), wanted=wanted)
    save("bench_moe", args.out, results)
    print(table(results))


if __name__ == "__main__":
    main()
