"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): router, top-k, grouped expert GEMMs, weighted combine.

Numerics, in HF's order (transformers 5.25 ``*TopKRouter`` + the ``grouped_mm`` experts path):
  r = x Wgᵀ                                     router logits (N, E), activation dtype, no bias
  p = softmax(fp32(r)) ; w, e = topk(p, k)      every row is routed: no capacity, no token dropping
  w = w / Σ w            if renormalize_top_k   (Mixtral always; Qwen3-MoE when norm_topk_prob)
  w = w.to(r.dtype)      if router_weights_in_activation_dtype   (Qwen3-MoE; Mixtral keeps them fp32)
  y[t] = Σ_j w[t,j] · down_e(act(gate_e x[t]) · up_e x[t]),  e = e[t,j]   (summed over j in slot order, cast once)

The experts never run in a Python loop: the N·k (token, expert) pairs are sorted by expert, each expert's rows are
multiplied by its weights in one grouped GEMM (``torch._grouped_mm`` / ``F.grouped_mm`` on CUDA in bf16; elsewhere
the rows are scattered into an (E, C, ·) zero-padded batch, C the largest group, and multiplied with one ``bmm``),
the gated activation is the fused kernel of the dense MLP, and the rows are put back in (token, slot) order, scaled
by their weights and summed over the k slots. The backward (``_Experts``) is the same grouped GEMMs transposed,
with the activation recomputed: it saves only the gate|up output per routed row, and the routing weights and the
router get their gradients as in HF.

Weights are held stacked, as transformers v5 holds them: ``experts.gate_up_proj`` (E, 2I, D) with rows [gate | up]
per expert, ``experts.down_proj`` (E, D, I). ``state_dict()`` and checkpoints use the per-expert names that
checkpoints on the Hub (and transformers' own save_pretrained) carry: ``experts.{e}.gate_proj.weight`` /
``up_proj`` / ``down_proj`` (Qwen3-MoE) or ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` (Mixtral: w1 gate,
w3 up, w2 down). ``load_state_dict`` and ``from_pretrained`` accept those and the stacked names
(``save_original_format=False`` checkpoints).

``output_router_logits``: each sparse layer's raw logits (N, E) are collected while ``recording_router_logits()``
is active; ``load_balancing_loss`` is HF's Switch-style auxiliary loss over them. It multiplies two means over the
batch, so data-parallel ranks do not get the whole batch's loss by adding up their own: within
``balancing_over_ranks()`` each rank's is its share of the whole batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from liger_models.kernels._custom_ops import absent, custom_op, refuse_double_backward
from liger_models.kernels._dispatch import once_differentiable
from liger_models.kernels.ops.gated_mlp import gated_backward_scaled, gated_forward
from liger_models.kernels.ops.slot_sum import slot_sum

from .config import LigerConfig

# The active recording's list, or None. A one-element list rather than a ContextVar: torch.compile traces reads
# of a module global (as attention.py's _STATIC_DOCUMENT_MASK), not ContextVar.get.
_RECORDED: list[list | None] = [None]
# While balancing_over_ranks() is active: the function that sums a tensor over the data-parallel ranks, in place.
_SUM_OVER_RANKS: list[Callable[[torch.Tensor], torch.Tensor] | None] = [None]
# False while stacked_state_dict() is active.
_PER_EXPERT_NAMES = [True]
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# The stacked expert Parameters, in Experts' order (PEFT nests its target_parameters wrappers in it).
STACKS = ("gate_up_proj", "down_proj")
EXPERT_PATHS = ("auto", "grouped_mm", "padded")


@contextlib.contextmanager
def recording_router_logits():
    """Within this context every sparse layer's forward appends its router logits (N, E) to the yielded list, in
    layer order. A checkpointed layer's recomputation in backward runs outside it and appends nothing."""
    logits: list[torch.Tensor] = []
    previous, _RECORDED[0] = _RECORDED[0], logits
    try:
        yield logits
    finally:
        _RECORDED[0] = previous


@contextlib.contextmanager
def balancing_over_ranks(sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]):
    """Within this context ``load_balancing_loss`` balances the batch that data-parallel ranks split, not each rank's
    part alone: ``sum_over_ranks`` (an in-place all-reduce) sums the experts' assignment counts and the row count over
    the ranks, and each rank returns E · Σ_e f_e · p_e, with f_e the whole batch's share of assignments and p_e the
    sum of this rank's probabilities of e over the whole batch's rows. The ranks' losses then add up to the whole
    batch's, and their gradients to its gradient (f has none: it counts top-k choices). Every rank must run the same
    forwards, as FSDP needs anyway."""
    previous, _SUM_OVER_RANKS[0] = _SUM_OVER_RANKS[0], sum_over_ranks
    try:
        yield
    finally:
        _SUM_OVER_RANKS[0] = previous


@contextlib.contextmanager
def stacked_state_dict():
    """Within this context ``state_dict()`` keeps each sparse block's stacked Parameters under their own names
    (``mlp.experts.gate_up_proj``, ``mlp.gate.weight``), which ``load_state_dict`` accepts too, instead of the
    per-expert names of checkpoints: for torch.distributed.checkpoint's ``get_model_state_dict``, which gathers FSDP
    shards and maps every key back to a module attribute, and to which a per-expert view of a sharded Parameter
    would be no tensor of its own."""
    previous, _PER_EXPERT_NAMES[0] = _PER_EXPERT_NAMES[0], False
    try:
        yield
    finally:
        _PER_EXPERT_NAMES[0] = previous


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_in_logits_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (N, k), experts (N, k) int64) from router logits (N, E), as HF's routers compute them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_logits_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


def _use_grouped_mm(x: torch.Tensor, *weights) -> bool:
    """torch's grouped GEMM: CUDA, bf16, and rows whose byte strides are multiples of 16 (its kernel's demand).
    ``weights``: the stacks (tensors in x's dtype, or NF4 stacks, which dequantise to it)."""
    if _GROUPED_MM is None or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all(w.shape[-1] * size % 16 == 0 and w.shape[-2] * size % 16 == 0 for w in weights)


def _dense(stack, dtype: torch.dtype) -> torch.Tensor:
    """A stack as the GEMMs take it: the tensor itself, or an NF4 stack (``NF4Weight``) dequantised to ``dtype``."""
    return stack if isinstance(stack, torch.Tensor) else stack.dequantize(dtype)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, expert_of_row: torch.Tensor,
                   path: str, bound: int) -> torch.Tensor:
    """rows (S, K) sorted by expert (counts (E,) rows each) times weight[e]ᵀ (E, N, K) of each row's expert → (S, N).

    "grouped_mm": one grouped GEMM over the groups' offsets. "padded": the rows scattered into a zero-padded
    (E, C, K) batch (C = the largest group, at most ``bound``; see _slots), one bmm, gathered back."""
    if path == "grouped_mm":
        return _GROUPED_MM(rows, weight.transpose(-2, -1), offs=torch.cumsum(counts, dim=0).to(torch.int32))
    slot, capacity = _slots(counts, expert_of_row, bound)
    padded = rows.new_zeros(weight.shape[0], capacity, rows.shape[1])
    padded[expert_of_row, slot] = rows
    return torch.bmm(padded, weight.transpose(-2, -1))[expert_of_row, slot]


def grouped_weight_grad(left: torch.Tensor, right: torch.Tensor, counts: torch.Tensor, expert_of_row: torch.Tensor,
                        path: str, bound: int) -> torch.Tensor:
    """Σ over each expert's rows of leftᵀ right: (E, P, Q) from left (S, P), right (S, Q) sorted by expert; zero for
    an expert without rows."""
    num_experts = counts.shape[0]
    if path == "grouped_mm":
        out = _GROUPED_MM(left.t(), right, offs=torch.cumsum(counts, dim=0).to(torch.int32))
        return out.masked_fill_((counts == 0)[:, None, None], 0)  # an empty group's block is not written
    slot, capacity = _slots(counts, expert_of_row, bound)
    a = left.new_zeros(num_experts, capacity, left.shape[1])
    b = right.new_zeros(num_experts, capacity, right.shape[1])
    a[expert_of_row, slot], b[expert_of_row, slot] = left, right
    return torch.bmm(a.transpose(1, 2), b)


def _slots(counts: torch.Tensor, expert_of_row: torch.Tensor, bound: int) -> tuple[torch.Tensor, int]:
    """Each sorted row's place within its expert's group, and the padded group size: the largest group (a host
    read), or ``bound`` (the token count, which no group exceeds: a token picks an expert once) while a CUDA graph
    is being captured, where a host read is not allowed."""
    starts = torch.cumsum(counts, dim=0) - counts
    slot = torch.arange(expert_of_row.shape[0], device=counts.device) - starts[expert_of_row]
    if counts.is_cuda and torch.cuda.is_current_stream_capturing():
        return slot, bound
    return slot, int(counts.max()) if counts.numel() else 0


class ExpertsLora(NamedTuple):
    """LoRA adapters on the stacked experts in PEFT's layout (modules/lora_experts.py): a1 (E·r1, D) and b1
    (2I, E·r1) on gate|up with scale s1, a2 (E·r2, I) and b2 (D, E·r2) on down with s2 (expert e's A is rows
    e·r…(e+1)·r, its B columns e, e + E, …); None (and 0.0) where a stack has none. Any float dtype: the GEMMs run
    in the activations' dtype, and the gradients come back in the adapters' own."""

    a1: torch.Tensor | None
    b1: torch.Tensor | None
    s1: float
    a2: torch.Tensor | None
    b2: torch.Tensor | None
    s2: float


class _Stacks(ExpertsLora):
    """ExpertsLora as the grouped GEMMs take it: a (E, r', in) and b (E, out, r') per stack in the activations'
    dtype, contiguous, r' = r padded with zero rows of A and columns of B to 16 bytes (the strides torch's grouped
    GEMM needs, ``_use_grouped_mm``: at r = 4 in bf16 the experts' base GEMMs would otherwise fall back to the
    padded-batch path). Built per call from the adapters (in forward and again in backward), never saved: at
    Qwen3-30B-A3B's width they are 41 MB per layer."""


def _padded_rank(a: torch.Tensor, num_experts: int, dtype: torch.dtype) -> int:
    """An adapter's rank r rounded up to 16 bytes of ``dtype`` (_Stacks)."""
    r = a.shape[0] // num_experts
    return r + -r % (128 // torch.finfo(dtype).bits)


def stack_factors(a: torch.Tensor, b: torch.Tensor, num_experts: int, dtype: torch.dtype):
    """Per-expert (A (E, r', in), B (E, out, r')) of an adapter in PEFT's layout (ExpertsLora), in ``dtype``,
    contiguous, detached, the rank padded with zeros to r' (_Stacks); B_e·A_e is each expert's own."""
    r = a.shape[0] // num_experts
    extra = _padded_rank(a, num_experts, dtype) - r
    a = a.detach().to(dtype).view(num_experts, r, -1)
    b = b.detach().to(dtype).view(b.shape[0], r, num_experts).permute(2, 0, 1)
    if extra:
        a, b = F.pad(a, (0, 0, 0, extra)), F.pad(b, (0, extra))
    return a.contiguous(), b.contiguous()


def _stacks(a1, b1, s1, a2, b2, s2, num_experts: int, dtype: torch.dtype) -> _Stacks | None:
    if a1 is None and a2 is None:
        return None
    up = stack_factors(a1, b1, num_experts, dtype) if a1 is not None else (None, None)
    down = stack_factors(a2, b2, num_experts, dtype) if a2 is not None else (None, None)
    return _Stacks(up[0], up[1], s1, down[0], down[1], s2)


def _unstacked(grad_a: torch.Tensor | None, grad_b: torch.Tensor | None, a: torch.Tensor | None,
               b: torch.Tensor | None, num_experts: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The stacks' gradients in the adapters' layout and dtype (the padding's rows and columns dropped)."""
    if a is None:
        return None, None
    r = a.shape[0] // num_experts
    if grad_a is not None:
        grad_a = grad_a[:, :r].reshape(a.shape).to(a.dtype)
    if grad_b is not None:
        grad_b = grad_b[:, :, :r].permute(1, 2, 0).reshape(b.shape).to(b.dtype)
    return grad_a, grad_b


def _experts_fwd(x, weights, gate_up, down, experts, activation: str, path: str, lora: _Stacks | None = None):
    """(y (N, D), the gate|up output (S, 2I), order, sorted expert ids, counts, u1, u2): the forward and what
    backward needs (``_Experts``); u1 = A1_e·x and u2 = A2_e·act per sorted row where ``lora`` adapts gate|up / down
    (else None)."""
    n_tokens, top_k = experts.shape
    flat = experts.reshape(-1)  # (S,) in (token, slot) order
    order = torch.argsort(flat, stable=True)
    expert_of_row = flat[order]
    # scatter_add, not bincount: no host read of the largest id (the grouped path then never syncs).
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))

    def linear(rows, weight):
        return grouped_linear(rows, weight, counts, expert_of_row, path, n_tokens)

    rows = x[order // top_k]
    hidden = linear(rows, gate_up)  # (S, 2I)
    u1 = u2 = None
    if lora is not None and lora.a1 is not None:  # + s·B_e·(A_e·x), accumulated into the base output
        u1 = linear(rows, lora.a1)
        hidden.add_(linear(u1, lora.b1), alpha=lora.s1)
    del rows
    inter = hidden.shape[1] // 2
    act = hidden.new_empty(hidden.shape[0], inter)
    if act.numel():
        gated_forward(hidden[:, :inter], hidden[:, inter:], act, activation)
    out = linear(act, down)  # (S, D)
    if lora is not None and lora.a2 is not None:
        u2 = linear(act, lora.a2)
        out.add_(linear(u2, lora.b2), alpha=lora.s2)
    del act
    y = slot_sum(out, _token_slots(order, weights.shape), weights, x.dtype)
    return y, hidden, order, expert_of_row, counts, u1, u2


def _experts_bwd(dy, x, weights, gate_up, down, hidden, order, expert_of_row, counts, activation: str, path: str,
                 top_k: int, needs: tuple[bool, ...], lora: _Stacks | None = None, u1=None, u2=None):
    """(d x, d weights, d gate_up, d down, d a1, d b1, d a2, d b2), None where ``needs`` (the same order) says no or
    there is no such adapter. Writes d gate|up over ``hidden``'s memory."""
    inter, n_tokens = hidden.shape[1] // 2, x.shape[0]

    def linear(rows, weight):
        return grouped_linear(rows, weight, counts, expert_of_row, path, n_tokens)

    def weight_grad(left, right):
        return grouped_weight_grad(left, right, counts, expert_of_row, path, n_tokens)

    token = order // top_k
    w_sorted = weights.reshape(-1)[order]
    g = dy[token].to(hidden.dtype)  # (S, D): each row's share of its token's gradient (the sum's adjoint)
    g_a = linear(g, down.transpose(-2, -1))  # (S, I) = g · down_e
    up_lora = lora is not None and lora.a1 is not None
    down_lora = lora is not None and lora.a2 is not None
    if down_lora:  # + s·(g·B_e)·A_e: g_a is then g times the adapted down_e, as d w and d act need
        g_b2 = linear(g, lora.b2.transpose(-2, -1))  # (S, r)
        g_a.add_(linear(g_b2, lora.a2.transpose(-2, -1)), alpha=lora.s2)
    # d act = w · g_a (in the promoted dtype, fp32 with Mixtral's weights, rounded once), d gate|up over the saved
    # output's memory, the recomputed activation, and d w = ⟨g_a, act⟩ (gated_backward_scaled: one kernel pass that
    # writes the activation over g_a, or the unfused passes).
    d_sorted = g_a.new_empty(g_a.shape[0], dtype=torch.float32) if needs[1] else None
    act = gated_backward_scaled(g_a, w_sorted, hidden[:, :inter], hidden[:, inter:], hidden[:, :inter],
                                hidden[:, inter:], activation, dots=d_sorted)
    d_hidden = hidden
    del g_a  # `act` is the activation's only name now (it may be g_a's memory), so that `del act` below frees it
    grads = [None] * 8  # x, weights, gate_up, down, a1, b1, a2, b2
    if needs[1]:
        d_weights = torch.empty_like(d_sorted)
        d_weights[order] = d_sorted
        grads[1] = d_weights.view(weights.shape).to(weights.dtype)
    if needs[3] or (down_lora and needs[7]):
        d_out = torch.mul(g, w_sorted[:, None], out=torch.empty_like(g))  # rounded once on store, as d_act
        if needs[3]:
            grads[3] = weight_grad(d_out, act).to(down.dtype)
        if down_lora and needs[7]:  # d B_e = s·Σ d_outᵀ·u2
            grads[7] = (weight_grad(d_out, u2) * lora.s2).to(lora.b2.dtype)
        del d_out
    if down_lora and needs[6]:  # d A_e = s·Σ (w·g·B_e)ᵀ·act
        grads[6] = (weight_grad((g_b2 * w_sorted[:, None]).to(hidden.dtype), act) * lora.s2).to(lora.a2.dtype)
    del act, g
    rows = x[token] if needs[2] or (up_lora and needs[4]) else None
    if needs[2]:
        grads[2] = weight_grad(d_hidden, rows).to(gate_up.dtype)
    d_b1 = linear(d_hidden, lora.b1.transpose(-2, -1)) if up_lora and (needs[0] or needs[4]) else None  # (S, r)
    if up_lora and needs[5]:  # d B_e = s·Σ d(gate|up)ᵀ·u1
        grads[5] = (weight_grad(d_hidden, u1) * lora.s1).to(lora.b1.dtype)
    if up_lora and needs[4]:  # d A_e = s·Σ (d(gate|up)·B_e)ᵀ·x
        grads[4] = (weight_grad(d_b1, rows) * lora.s1).to(lora.a1.dtype)
    del rows
    if needs[0]:
        d_rows = linear(d_hidden, gate_up.transpose(-2, -1))
        if d_b1 is not None:
            d_rows.add_(linear(d_b1, lora.a1.transpose(-2, -1)), alpha=lora.s1)
        grads[0] = slot_sum(d_rows, _token_slots(order, (n_tokens, top_k)), out_dtype=x.dtype)
    return tuple(grads)


class _Experts(torch.autograd.Function):
    """The routed experts, forward and backward, saving only the input x (N, D) (which the router's linear saves
    anyway), the routing and the gate|up GEMM output (S, 2I) for backward: HF's composed path also keeps the
    gathered rows (S, D), the activation (S, I) and the down output (S, D).

    Backward, per sorted row r of expert e with weight w and incoming gradient g (the row's token's):
      g_a = g · down_e            (S, I), one grouped GEMM
      d w = ⟨g_a, a⟩              (= ⟨g, down_e a⟩, the weight's gradient, with a = act(gate)·up recomputed)
      d a = w · g_a  → d gate|up  by the fused gated kernel, written over the saved gate|up output
      d down_e = Σ (w g)ᵀ a,  d gate_up_e = Σ d(gate|up)ᵀ x_r,  d x_r = d(gate|up) · gate_up_e
    With adapters (``ExpertsLora``) down_e and gate_up_e above are the adapted W_e + s·B_e·A_e, applied as two thin
    grouped GEMMs each way; forward also saves u = A_e·(its input) per row (S × r), and
      d B_e = s·Σ (d out)ᵀ u,  d A_e = s·Σ ((d out)·B_e)ᵀ (the input)   for each adapted stack.
    """

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, experts, activation, path, a1, b1, s1, a2, b2, s2):
        # NF4 stacks (QLoRA) are dequantised here and again in backward, never saved: a layer's dense experts are
        # 1.2 GB at Qwen3-30B-A3B's width.
        ctx.nf4 = tuple(None if isinstance(w, torch.Tensor) else w for w in (gate_up, down))
        dense = [_dense(w, x.dtype) for w in (gate_up, down)]
        lora = _stacks(a1, b1, s1, a2, b2, s2, gate_up.shape[0], x.dtype)
        y, *saved = _experts_fwd(x, weights, *dense, experts, activation, path, lora)
        kept = [None if q is not None else w for q, w in zip(ctx.nf4, dense)]
        ctx.save_for_backward(x, weights, *kept, *saved[:4], a1, b1, a2, b2, *saved[4:])
        ctx.activation, ctx.path, ctx.top_k, ctx.scales = activation, path, experts.shape[1], (s1, s2)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weights, gate_up, down, *rest = ctx.saved_tensors
        gate_up, down = (_dense(q, x.dtype) if q is not None else w for q, w in zip(ctx.nf4, (gate_up, down)))
        base = [weights, gate_up, down, *rest[:4]]
        a1, b1, a2, b2, u1, u2 = rest[4:]
        needs = tuple(ctx.needs_input_grad[:4]) + tuple(ctx.needs_input_grad[i] for i in (7, 8, 10, 11))
        grads = _adapted_backward(dy, x, base, a1, b1, ctx.scales[0], a2, b2, ctx.scales[1], u1, u2,
                                  ctx.activation, ctx.path, ctx.top_k, needs)
        return (*grads[:4], None, None, None, grads[4], grads[5], None, grads[6], grads[7], None)


def _adapted_backward(dy, x, base, a1, b1, s1, a2, b2, s2, u1, u2, activation, path, top_k, needs):
    """_experts_bwd with the adapters' stacks rebuilt, its eight gradients (x, weights, gate_up, down, a1, b1, a2,
    b2) with the adapters' in their own layout."""
    experts = base[1].shape[0]
    lora = _stacks(a1, b1, s1, a2, b2, s2, experts, x.dtype)
    grads = _experts_bwd(dy, x, *base, activation, path, top_k, needs, lora, u1, u2)
    return (*grads[:4], *_unstacked(grads[4], grads[5], a1, b1, experts), *_unstacked(grads[6], grads[7], a2, b2,
                                                                                     experts))


# ---- the same as custom ops, for torch.compile (liger_models/kernels/_custom_ops.py) -----------------------------

@custom_op("moe_experts")
def _experts_op(x: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                experts: torch.Tensor, activation: str, path: str, a1: Optional[torch.Tensor],
                b1: Optional[torch.Tensor], s1: float, a2: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                s2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    """_Experts' forward: (y, gate|up output, order, sorted expert ids, counts, u1, u2), placeholders for the u of
    a stack without an adapter."""
    lora = _stacks(a1, b1, s1, a2, b2, s2, gate_up.shape[0], x.dtype)
    out = _experts_fwd(x, weights, gate_up, down, experts, activation, path, lora)
    return (*out[:5], *(absent(x) if u is None else u for u in out[5:]))


@_experts_op.register_fake
def _(x, weights, gate_up, down, experts, activation, path, a1, b1, s1, a2, b2, s2):
    rows = experts.numel()
    return (x.new_empty(x.shape), x.new_empty(rows, gate_up.shape[1]), experts.new_empty(rows),
            experts.new_empty(rows), experts.new_empty(gate_up.shape[0]),
            absent(x) if a1 is None else x.new_empty(rows, _padded_rank(a1, gate_up.shape[0], x.dtype)),
            absent(x) if a2 is None else x.new_empty(rows, _padded_rank(a2, gate_up.shape[0], x.dtype)))


@custom_op("moe_experts_backward")
def _experts_backward_op(dy: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, hidden: torch.Tensor, order: torch.Tensor, expert_of_row: torch.Tensor,
                         counts: torch.Tensor, activation: str, path: str, top_k: int, needs: list[bool],
                         a1: Optional[torch.Tensor], b1: Optional[torch.Tensor], s1: float,
                         a2: Optional[torch.Tensor], b2: Optional[torch.Tensor], s2: float, u1: torch.Tensor,
                         u2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_Experts' backward on a copy of the gate|up output (an op may not write its inputs); placeholders for the
    gradients not asked for (x, weights, gate_up, down, a1, b1, a2, b2)."""
    grads = _adapted_backward(dy, x, (weights, gate_up, down, hidden.clone(), order, expert_of_row, counts), a1, b1,
                              s1, a2, b2, s2, u1, u2, activation, path, top_k, tuple(needs))
    return tuple(absent(x) if g is None else g for g in grads)


@_experts_backward_op.register_fake
def _(dy, x, weights, gate_up, down, hidden, order, expert_of_row, counts, activation, path, top_k, needs, a1, b1,
      s1, a2, b2, s2, u1, u2):
    like = (x, weights, gate_up, down, a1, b1, a2, b2)
    return tuple(torch.empty_like(t) if need and t is not None else absent(x) for t, need in zip(like, needs))


def _experts_setup(ctx, inputs, output) -> None:
    x, weights, gate_up, down, experts, ctx.activation, ctx.path, a1, b1, s1, a2, b2, s2 = inputs
    ctx.save_for_backward(x, weights, gate_up, down, *output[1:5], a1, b1, a2, b2, *output[5:])
    ctx.top_k, ctx.scales = experts.shape[1], (s1, s2)
    ctx.mark_non_differentiable(*output[1:])


def _experts_grads(ctx, dy, *_):
    refuse_double_backward("moe_experts")
    *base, a1, b1, a2, b2, u1, u2 = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[i]) for i in (0, 1, 2, 3, 7, 8, 10, 11)]
    grads = _experts_backward_op(dy, *base, ctx.activation, ctx.path, ctx.top_k, needs, a1, b1, ctx.scales[0],
                                 a2, b2, ctx.scales[1], u1, u2)
    grads = [g if need else None for g, need in zip(grads, needs)]
    return (*grads[:4], None, None, None, grads[4], grads[5], None, grads[6], grads[7], None)


_experts_op.register_autograd(_experts_grads, setup_context=_experts_setup)


def _token_slots(order: torch.Tensor, shape) -> torch.Tensor:
    """(N, k): the sorted row of each (token, slot) pair, for the rows ``order`` sorted (the inverse permutation).
    Summing a token's k rows (``slot_sum``, weighted in forward as HF's grouped path weights them, plain in
    backward) then reads each sorted row once, in its own dtype."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse.view(shape)


def experts_forward(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, activation: str, path: str = "auto",
                    lora: ExpertsLora | None = None) -> torch.Tensor:
    """Σ_j weights[:, j] · expert_{experts[:, j]}(x) for x (N, D), weights / experts (N, k), gate_up (E, 2I, D),
    down (E, D, I) → (N, D) in x's dtype; differentiable in x, weights, gate_up, down and the adapters of ``lora``
    (each expert's weights then W_e + s·B_e·A_e, never formed). gate_up / down may be NF4 stacks (QLoRA's frozen
    ``NF4Weight``), dequantised in forward and again in backward. path: "auto" (grouped_mm where
    ``_use_grouped_mm``, else padded), or one of them forced (tests run both)."""
    if path not in EXPERT_PATHS:
        raise ValueError(f"path must be one of {EXPERT_PATHS}, got {path!r}")
    if experts.shape != weights.shape or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(f"weights {tuple(weights.shape)} and experts {tuple(experts.shape)} must both be (N, k) "
                         f"for x {tuple(x.shape)}")
    if torch.is_autocast_enabled(x.device.type):  # the GEMMs in autocast's dtype, as nn.Linear's would run
        dtype = torch.get_autocast_dtype(x.device.type)
        x = x.to(dtype)
        gate_up, down = (w.to(dtype) if isinstance(w, torch.Tensor) else w for w in (gate_up, down))
    dense = [w for w in (gate_up, down) if isinstance(w, torch.Tensor)]  # NF4 stacks dequantise to x's dtype
    if any(w.dtype != x.dtype for w in dense):
        raise TypeError(f"x ({x.dtype}) and the expert weights ({', '.join(str(w.dtype) for w in dense)}) must "
                        "share a dtype")
    if path == "auto":
        path = "grouped_mm" if _use_grouped_mm(x, gate_up, down) else "padded"
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    a1, b1, s1, a2, b2, s2 = lora if lora is not None else (None, None, 0.0, None, None, 0.0)
    if torch.compiler.is_compiling():  # NF4 stacks dequantised in the graph (saved by autograd there)
        gate_up, down = _dense(gate_up, x.dtype), _dense(down, x.dtype)
        return _experts_op(x, weights, gate_up, down, experts, activation, path, a1, b1, s1, a2, b2, s2)[0]
    return _Experts.apply(x, weights, gate_up, down, experts, activation, path, a1, b1, s1, a2, b2, s2)


def load_balancing_loss(router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """HF's ``load_balancing_loss_func``: E · Σ_e f_e · P_e over all sparse layers' rows, where f_e is the share of
    top-k assignments that went to expert e (per row, k of them) and P_e the mean router probability of e; rows
    where the 2D attention_mask (B, T), flattened as the logits' rows, is 0 do not count. Balanced routing gives k."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one sparse layer")
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as HF
        chosen = torch.topk(probs, top_k, dim=-1).indices
        if mask is not None and mask.numel() != probs.shape[0]:
            raise ValueError(f"attention_mask has {mask.numel()} entries for {probs.shape[0]} router rows")
        per_row = torch.ones(probs.shape[0], dtype=torch.float32, device=device) if mask is None else mask
        counts = counts.scatter_add(0, chosen.reshape(-1), per_row.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs.float() * per_row[:, None]).sum(dim=0)
        rows = rows + per_row.sum()
    sum_over_ranks = _SUM_OVER_RANKS[0]
    if sum_over_ranks is not None:  # balancing_over_ranks: the whole batch's f and row count
        totals = sum_over_ranks(torch.cat([counts, rows.view(1)]))
        counts, rows = totals[:-1], totals[-1]
    return num_experts * torch.sum((counts / rows) * (prob_sums / rows))


class Experts(nn.Module):
    """The stacked expert weights: gate_up_proj (E, 2I, D), rows [gate | up] per expert, and down_proj (E, D, I).

    Quantised (``quantize_``, QLoRA) each stack is an NF4Weight in ``nf4`` under the same name and the Parameter is
    None: dequantised per call, outside the state dict as the NF4 linears are (the frozen base is rebuilt from the
    dense checkpoint)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.nf4 = nn.ModuleDict()

    @property
    def num_experts(self) -> int:
        return self.stack("gate_up_proj").shape[0]

    def stack(self, name: str):
        """The stack ``name`` as the routed experts take it: the Parameter, or its NF4Weight when quantised."""
        return self.nf4[name] if name in self.nf4 else getattr(self, name)

    def dense_stack(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stack's weights as a tensor (dequantised from NF4 when quantised), in ``dtype`` if given."""
        if name in self.nf4:
            return self.nf4[name].dequantize(dtype)
        w = getattr(self, name)
        return w if dtype is None else w.to(dtype)

    @torch.no_grad()
    def quantize_(self, quantize: Callable[[torch.Tensor], nn.Module]) -> list[str]:
        """Each dense stack to ``quantize(weight)`` (an NF4Weight, lora.attach.quantize_base_'s); the names done."""
        done = []
        for name in STACKS:
            if name not in self.nf4:
                self.nf4[name] = quantize(getattr(self, name))
                self.register_parameter(name, None)
                done.append(name)
        return done

    def adapters(self) -> ExpertsLora | None:
        """The LoRA adapters the grouped GEMMs apply (modules/lora_experts.py's LoraExperts has them)."""
        return None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, activation: str,
                path: str = "auto") -> torch.Tensor:
        """experts_forward over this module's stacks. The block calls the module (rather than reading its
        Parameters) so that a wrapper sees the call: PEFT's target_parameters wrapper parametrises
        ``gate_up_proj`` / ``down_proj`` to W + s·B·A for the duration of the call, as it does around HF's."""
        return experts_forward(x, weights, experts, self.stack("gate_up_proj"), self.stack("down_proj"),
                               activation, path, self.adapters())


class SparseMoeBlock(nn.Module):
    """HF names: ``gate`` (the router, a bias-free (E, D) linear) and ``experts`` (stacked, see Experts)."""

    def __init__(self, config: LigerConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.experts_count
        if not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"num_experts_per_tok must be in 1 … {self.num_experts} experts, got {self.top_k!r}")
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = Experts(self.num_experts, config.hidden_size, config.expert_intermediate_size)
        self.activation = config.activation
        self.renormalize = config.renormalize_top_k
        self.weights_in_logits_dtype = config.router_weights_in_activation_dtype
        self.jitter_noise = config.router_jitter_noise
        self.path = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D), the post-attention norm's output → the weighted expert outputs (..., D)."""
        shape = x.shape
        if self.training and self.jitter_noise > 0:  # Mixtral: the experts see the jittered input too
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)  # (N, E)
        recorded = _RECORDED[0]
        if recorded is not None:
            recorded.append(logits)
        weights, experts = route(logits, self.top_k, self.renormalize, self.weights_in_logits_dtype)
        out = self.experts(x, weights, experts, self.activation, self.path)
        return out.view(shape)


# ---- checkpoint names: per-expert on disk, stacked in memory -------------------------------------------------

def _per_expert(num_experts: int, disk_prefix: str, names: tuple[str, str, str]) -> list[tuple[int, str, str]]:
    """(expert, role, name) for each per-expert tensor; role is gate / up / down, names the family's (gate, up,
    down) tensor names."""
    return [(e, role, f"{disk_prefix}experts.{e}.{name}.weight")
            for e in range(num_experts) for role, name in zip(("gate", "up", "down"), names)]


def per_expert_tensors(gate_up: torch.Tensor, down: torch.Tensor, disk_prefix: str,
                       names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors of two stacks, as views of them, keyed by their names under
    disk_prefix (``experts.{e}.{gate|up|down name}.weight``)."""
    inter = down.shape[2]
    parts = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
    return {name: down[e] if role == "down" else gate_up[e, parts[role]]
            for e, role, name in _per_expert(gate_up.shape[0], disk_prefix, names)}


def per_expert_state_dict(block: SparseMoeBlock, state_dict: dict, block_prefix: str, disk_prefix: str,
                          names: tuple[str, str, str]) -> None:
    """Rewrite block's entries of a state_dict (under block_prefix) to the on-disk names under disk_prefix: the
    router as ``gate.weight``, each expert's weights as their own tensors. With keep_vars (Parameters in the dict)
    they are views of the stacked Parameters (a loader copies into them); else own copies, since savers refuse
    tensors that share storage. Nothing is renamed within ``stacked_state_dict()``."""
    if not _PER_EXPERT_NAMES[0]:
        return
    # A module PEFT wrapped (its LoRA around the router, its target_parameters wrappers around the experts) keeps
    # the wrapper's names (``gate.base_layer.weight``, ``experts.base_layer.base_layer.gate_up_proj``), as HF +
    # PEFT's state dict has them.
    if block_prefix + "gate.weight" in state_dict:
        state_dict[disk_prefix + "gate.weight"] = state_dict.pop(block_prefix + "gate.weight")
    if block_prefix + "experts.gate_up_proj" not in state_dict:
        return
    stacked = state_dict.pop(block_prefix + "experts.gate_up_proj")
    state_dict.pop(block_prefix + "experts.down_proj")
    keep_vars = isinstance(stacked, nn.Parameter)
    views = per_expert_tensors(block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), disk_prefix,
                               names)
    state_dict.update({name: view if keep_vars else view.clone() for name, view in views.items()})


def stacked_from_per_expert(state_dict: dict, block_prefix: str, disk_prefixes: tuple[str, ...],
                            names: tuple[str, str, str], num_experts: int) -> None:
    """The inverse for ``load_state_dict``: per-expert (or stacked) entries under any of disk_prefixes become the
    block's stacked ``experts.gate_up_proj`` / ``experts.down_proj`` and ``gate.weight``. Entries that are absent
    are left absent, so strict loading names them as missing."""
    for prefix in disk_prefixes:
        if prefix + "gate.weight" in state_dict:
            state_dict[block_prefix + "gate.weight"] = state_dict.pop(prefix + "gate.weight")
        for stacked in STACKS:
            if prefix + "experts." + stacked in state_dict:
                state_dict[block_prefix + "experts." + stacked] = state_dict.pop(prefix + "experts." + stacked)
        entries = _per_expert(num_experts, prefix, names)
        if not any(name in state_dict for _, _, name in entries):
            continue
        parts = {role: [] for role in ("gate", "up", "down")}
        for _, role, name in entries:
            if name not in state_dict:
                return  # incomplete: leave the pieces, strict loading reports them
            parts[role].append(state_dict.pop(name))
        state_dict[block_prefix + "experts.gate_up_proj"] = torch.cat(
            (torch.stack(parts["gate"]), torch.stack(parts["up"])), dim=1)
        state_dict[block_prefix + "experts.down_proj"] = torch.stack(parts["down"])


def stacked_checkpoint_names(state: dict, stored: set[str], block: SparseMoeBlock, disk_prefixes: tuple[str, ...],
                             per_expert_prefix: str, names: tuple[str, str, str]) -> None:
    """For a loader reading tensors by name: where a checkpoint stores this block stacked (``experts.gate_up_proj``
    under one of disk_prefixes, as transformers' ``save_original_format=False`` writes it), expect the stacked
    Parameters under those names instead of the per-expert views ``state`` holds (keep_vars state)."""
    for prefix in disk_prefixes:
        if prefix + "experts.gate_up_proj" not in stored:
            continue
        for _, _, name in _per_expert(block.num_experts, per_expert_prefix, names):
            state.pop(name, None)
        state[prefix + "gate.weight"] = state.pop(per_expert_prefix + "gate.weight")
        state[prefix + "experts.gate_up_proj"] = block.experts.gate_up_proj
        state[prefix + "experts.down_proj"] = block.experts.down_proj
        return
