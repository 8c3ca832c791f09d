"""The shared mixture-of-experts pieces (liger_models/modules/moe.py) against a per-expert Python loop in float64:
routing (ties, renormalisation both ways, the weights' dtype), the grouped expert GEMMs on both paths (odd token
counts, experts that receive no token), forward and backward, and HF's auxiliary load-balancing loss."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

import liger_models.modules.moe as moe
from liger_models.kernels._dispatch import reference_mode
from liger_models.kernels.ops import gated_mlp as gm
from liger_models.modules.moe import experts_forward, load_balancing_loss, route

from ..helpers import LiveBytes, SavedBytes

PATHS = ["padded", "grouped_mm"]


def loop_reference(x, weights, experts, gate_up, down):
    """Σ_j w[t, j] · down_e(silu(gate_e x) · up_e x) token by token and slot by slot, in float64."""
    x, gate_up, down, weights = x.double(), gate_up.double(), down.double(), weights.double()
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _case(n_tokens, num_experts=4, top_k=2, hidden=16, inter=8, dtype=torch.float32):
    x = torch.randn(n_tokens, hidden, dtype=dtype, requires_grad=True)
    gate_up = (0.3 * torch.randn(num_experts, 2 * inter, hidden, dtype=dtype)).requires_grad_()
    down = (0.3 * torch.randn(num_experts, hidden, inter, dtype=dtype)).requires_grad_()
    return x, gate_up, down


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_tokens", [1, 7, 13])
def test_experts_forward_and_backward_equal_the_loop(path, n_tokens):
    x, gate_up, down = _case(n_tokens)
    logits = torch.randn(n_tokens, 4, requires_grad=True)
    weights, experts = route(logits, 2, renormalize=True, weights_in_logits_dtype=False)
    out = experts_forward(x, weights, experts, gate_up, down, "silu", path)
    leaves = (x, gate_up, down, logits)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_weights, _ = route(ref_leaves[3], 2, renormalize=True, weights_in_logits_dtype=False)
    ref = loop_reference(ref_leaves[0], ref_weights, experts, ref_leaves[1], ref_leaves[2])
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    grad = torch.randn_like(ref)
    out.backward(grad.float())
    ref.backward(grad)
    for name, mine, theirs in zip(("x", "gate_up", "down", "router logits"), leaves, ref_leaves):
        scale = max(1.0, theirs.grad.abs().max().item())
        assert (mine.grad.double() - theirs.grad).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("path", PATHS)
def test_an_expert_with_no_tokens_gets_zero_gradient(path):
    x, gate_up, down = _case(5, num_experts=4)
    experts = torch.tensor([[0, 1], [1, 0], [0, 3], [3, 1], [1, 0]])  # expert 2 receives nothing
    weights = torch.rand(5, 2)
    out = experts_forward(x, weights, experts, gate_up, down, "silu", path)
    ref = loop_reference(x, weights, experts, gate_up, down)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    out.sum().backward()
    assert torch.all(gate_up.grad[2] == 0) and torch.all(down.grad[2] == 0)
    assert gate_up.grad[0].abs().sum() > 0


def test_every_token_to_one_expert():
    x, gate_up, down = _case(6, num_experts=3, top_k=1)
    experts = torch.full((6, 1), 2)
    weights = torch.ones(6, 1)
    out = experts_forward(x, weights, experts, gate_up, down, "silu", "padded")
    ref = loop_reference(x, weights, experts, gate_up, down)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def test_grouped_mm_path_equals_padded_path():
    x, gate_up, down = _case(11, num_experts=4, hidden=16, inter=8)
    weights, experts = route(torch.randn(11, 4), 2, renormalize=False, weights_in_logits_dtype=False)
    a = experts_forward(x, weights, experts, gate_up, down, "silu", "grouped_mm")
    b = experts_forward(x, weights, experts, gate_up, down, "silu", "padded")
    assert (a - b).abs().max().item() <= 1e-5


def test_routing_ties_pick_what_torch_topk_picks():
    # All logits equal (a zero-initialised router): every probability is 1/E; the selection is torch.topk's, as HF's.
    logits = torch.zeros(6, 8)
    weights, experts = route(logits, 2, renormalize=False, weights_in_logits_dtype=False)
    assert torch.equal(experts, torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices)
    assert torch.allclose(weights, torch.full((6, 2), 1 / 8))
    # A tie between the 2nd and 3rd logits of one row, otherwise distinct.
    logits = torch.tensor([[3.0, 1.0, 1.0, -2.0]])
    _, experts = route(logits, 2, renormalize=True, weights_in_logits_dtype=False)
    assert torch.equal(experts, torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_renormalisation_and_weight_dtype(renormalize):
    logits = torch.randn(9, 6, dtype=torch.bfloat16)
    weights, experts = route(logits, 3, renormalize=renormalize, weights_in_logits_dtype=True)
    probs = torch.softmax(logits.double(), -1)
    expected = probs.gather(1, experts)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    assert weights.dtype == torch.bfloat16
    assert (weights.double() - expected).abs().max().item() <= 4e-3
    fp32_weights, _ = route(logits, 3, renormalize=renormalize, weights_in_logits_dtype=False)
    assert fp32_weights.dtype == torch.float32
    assert torch.allclose(fp32_weights.sum(-1), torch.ones(9)) == renormalize


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_hf(masked):
    layers = tuple(torch.randn(2 * 7, 5) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, :3] = 0
    ours = load_balancing_loss(layers, 5, 2, mask)
    theirs = load_balancing_loss_func(layers, 5, 2, mask)
    assert abs(ours.item() - theirs.item()) <= 1e-6


def test_balanced_routing_gives_top_k():
    # Each row sends its two picks to a different pair, cycling over all experts evenly, with uniform probabilities.
    logits = torch.zeros(8, 4)
    logits[torch.arange(8), torch.arange(8) % 4] = 1e-3
    logits[torch.arange(8), (torch.arange(8) + 1) % 4] = 1e-3
    assert abs(load_balancing_loss((logits,), 4, 2).item() - 2.0) <= 1e-3


def test_bad_path_is_refused():
    x, gate_up, down = _case(3)
    with pytest.raises(ValueError, match="path must be one of"):
        experts_forward(x, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), gate_up, down, "silu", "loop")


def test_backward_saves_only_the_gate_up_output_per_routed_row():
    # What autograd keeps between forward and backward (parameters aside): the input x (N, D), the gate|up output
    # (N·k, 2I), the routing (int64 order, expert ids, counts) and weights; not the rows, activation or expert output.
    n_tokens, hidden, inter, num_experts, top_k = 32, 64, 48, 4, 2
    x, gate_up, down = _case(n_tokens, num_experts, top_k, hidden, inter)
    logits = torch.randn(n_tokens, num_experts, requires_grad=True)
    weights, experts = route(logits, top_k, renormalize=True, weights_in_logits_dtype=False)
    with SavedBytes(exclude=(gate_up, down)) as saved:
        experts_forward(x, weights, experts, gate_up, down, "silu", "padded")
    rows = n_tokens * top_k
    allowed = n_tokens * hidden * 4 + rows * 2 * inter * 4 + rows * (3 * 8 + 4) + num_experts * 8
    assert saved.total <= allowed, (saved.total, allowed)


@pytest.mark.parametrize("kernels", ["fused", "unfused", "reference"])
@pytest.mark.parametrize("path", PATHS)
def test_routing_weights_gradient_equals_the_loop(path, kernels, tune):
    # The routing weights' gradient comes from the fused activation backward's row dots (the default), or from the
    # unfused passes (and the PyTorch path in reference mode) a few rows at a time: chunks of 3 rows over 26 sorted
    # rows, the last one short.
    x, gate_up, down = _case(13)
    logits = torch.randn(13, 4, requires_grad=True)
    weights, experts = route(logits, 2, renormalize=False, weights_in_logits_dtype=False)
    weights.retain_grad()
    ref_weights = weights.detach().double().requires_grad_()
    ref = loop_reference(x.detach(), ref_weights, experts, gate_up.detach(), down.detach())
    grad = torch.randn_like(ref)
    ref.backward(grad)
    tune(gm, row_dot_elements=3 * 8 + 5, fuse_scaled_backward=kernels == "fused")
    with reference_mode() if kernels == "reference" else contextlib.nullcontext():
        experts_forward(x, weights, experts, gate_up, down, "silu", path).backward(grad.float())
    scale = max(1.0, ref_weights.grad.abs().max().item())
    assert (weights.grad.double() - ref_weights.grad).abs().max().item() <= 1e-5 * scale


@pytest.mark.skipif(moe._GROUPED_MM is None, reason="this torch has no grouped GEMM")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_the_bf16_backward_holds_no_fp32_copy_of_the_activation(fused, tune):
    # bf16 with Mixtral's fp32 routing weights, where a product with them promotes to fp32. Beyond what forward
    # saved (the gate|up output (S, 2I), whose gradient backward writes over it) the backward holds at its peak
    # (S, I) bf16 tensors, g · down_e and the recomputed activation (one: the fused activation backward writes the
    # activation over g · down_e; two: the unfused passes form it apart, with fp32 row chunks of 128 rows for the
    # routing weights' gradient), the expert weights' gradients and (S, D)-sized rows. One more (S, I) tensor (or
    # any (S, I) fp32 copy for the routing weights' gradient) would exceed what is left.
    n_tokens, hidden, inter, num_experts, top_k = 512, 32, 512, 4, 2
    rows = n_tokens * top_k
    x, gate_up, down = (t.detach().bfloat16().requires_grad_() for t in _case(n_tokens, num_experts, top_k, hidden,
                                                                                 inter))
    logits = torch.randn(n_tokens, num_experts, requires_grad=True)
    weights, experts = route(logits, top_k, renormalize=True, weights_in_logits_dtype=False)
    dy = torch.randn(n_tokens, hidden, dtype=torch.bfloat16)
    out = experts_forward(x, weights, experts, gate_up, down, "silu", "grouped_mm")
    tune(gm, fuse_scaled_backward=fused, row_dot_elements=128 * inter)
    with LiveBytes() as live:
        out.backward(dy)
    bf16, fp32 = 2, 4
    bound = (gate_up.numel() + down.numel()) * bf16 + 4 * rows * hidden * fp32
    bound += rows * inter * bf16 if fused else 2 * rows * inter * bf16 + 128 * inter * fp32
    assert live.peak <= bound < live.peak + rows * inter * bf16, (live.peak, bound)


def test_autocast_runs_the_experts_in_bf16():
    x, gate_up, down = _case(9)
    weights, experts = route(torch.randn(9, 4), 2, renormalize=True, weights_in_logits_dtype=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts_forward(x, weights, experts, gate_up, down, "silu", "padded")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert gate_up.grad.dtype == torch.float32 and gate_up.grad.abs().sum() > 0
    ref = loop_reference(x, weights, experts, gate_up, down)
    assert (out.double() - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_activation_checkpointing_keeps_loss_aux_loss_and_gradients(family):
    # The recomputation in backward runs outside the recording: the aux loss is counted once, gradients unchanged.
    from liger_models import (LigerMixtralForCausalLM, LigerQwen3MoeForCausalLM, MixtralConfig,
                              Qwen3MoeConfig)

    cls, config = {"mixtral": (LigerMixtralForCausalLM, MixtralConfig.tiny()),
                   "qwen3_moe": (LigerQwen3MoeForCausalLM, Qwen3MoeConfig.tiny())}[family]
    model = cls.from_config(config).train()
    ids = torch.randint(3, 128, (2, 10))
    results = []
    for checkpointed in (False, True):
        if checkpointed:
            model.gradient_checkpointing_enable()
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        results.append((out.loss.detach(), out.aux_loss.detach(), {n: p.grad.clone() for n, p in
                                                                    model.named_parameters()}))
    (loss0, aux0, grads0), (loss1, aux1, grads1) = results
    assert torch.equal(loss0, loss1) and torch.equal(aux0, aux1)
    for name, grad in grads0.items():
        assert torch.equal(grads1[name], grad), name
