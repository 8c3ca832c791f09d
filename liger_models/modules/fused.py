"""Training-memory fusions around the GEMMs: each saves the least that its backward needs and recomputes the rest.

norm → projection (``norm_linear``): [residual add +] RMSNorm, then the packed q|k|v or gate|up GEMM. Composed from
the separate Functions, the norm saves its input r and the GEMM saves the normalised y = norm(r): two (N, H)
tensors. Here only r (the residual stream, which the next norm's backward needs anyway) and rstd (4 B/row) are
saved; the backward recomputes y from them with the same kernel (bit-identical: the forward also normalised the
rounded r), uses it for dW and drops it. One extra memory-bound pass over (N, H) per norm, next to an (N, H)×(H, K)
GEMM.

gated activation → down projection (``gated_down``): act(gate) * up feeding down_proj. Composed, the activation
saves gate_up (N, 2I) and down_proj saves the product (N, I). Here only gate_up is saved; the backward computes
d act = dout @ W_down first, then one kernel pass reads gate_up and d act and writes d gate_up over gate_up's
memory and the recomputed product over d act's, which then feeds dW_down. The product costs no memory and no
extra read of gate_up (the activation's own backward reads the same bytes).

Llama-3.2-1B (H 2048, I 8192): 75.9 → 51.3 KB saved per token per layer (benchmarks/tools/saved_activations.py).
Both paths apply only where the Triton kernels run with autograd recording (CUDA, or CPU under TRITON_INTERPRET)
and the projections are plain nn.Linear (linear.is_plain_linear); elsewhere (CPU reference, inference, autocast, a
PEFT-wrapped projection) the modules compose exactly as before.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd.graph import increment_version

from liger_models.kernels._custom_ops import absent, custom_op, refuse_double_backward
from liger_models.kernels._dispatch import row_view, use_triton
from liger_models.kernels.ops.gated_mlp import gated_backward, gated_forward, owns_memory
from liger_models.kernels.ops.gated_mlp import gated_mlp_packed
from liger_models.kernels.ops.rms_norm import RMSNorm, norm_backward, norm_forward

from .linear import _stacked, all_plain, is_plain_linear, packed_linear
from .lora_linear import (Group, backward_weight, core_backward_A, core_backward_input, core_backward_magnitude,
                          core_forward, dora_scaled_grad, frozen_bases, is_lora_group)


class _NormLinear(torch.autograd.Function):
    """(x [+ residual]) → RMSNorm → one GEMM against the stacked weights; saves the norm's input and rstd only."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, eps, offset, gemma, n, *params):
        weights, biases = list(params[:n]), list(params[n:])
        out, xs, r, rstd = _norm_linear_forward(x, residual, norm_weight, weights, biases, eps, offset, gemma)
        ctx.save_for_backward(xs, rstd, norm_weight, *weights)
        ctx.n, ctx.has_bias, ctx.rows = n, bool(biases), [wt.shape[0] for wt in weights]
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        ctx.x_shape, ctx.residual_dtype = x.shape, None if residual is None else residual.dtype
        return out if r is None else (out, r.view(x.shape))

    @staticmethod
    def backward(ctx, dout, dres=None):
        xs, rstd, norm_weight, *weights = ctx.saved_tensors
        need_dws = any(ctx.needs_input_grad[7 : 7 + ctx.n])
        dx, dnw, dw, db = _norm_linear_backward(dout, dres, xs, rstd, norm_weight, weights, ctx.eps, ctx.offset,
                                                ctx.gemma, need_dws, ctx.needs_input_grad[2], ctx.has_bias)
        dws = list(dw.split(ctx.rows)) if need_dws else [None] * ctx.n  # one GEMM, sliced per weight
        dbs = list(db.split(ctx.rows)) if ctx.has_bias else []
        dx = dx.view(ctx.x_shape)
        dr = dx.to(ctx.residual_dtype) if ctx.residual_dtype is not None and ctx.needs_input_grad[1] else None
        return (dx, dr, dnw, None, None, None, None, *dws, *dbs)


class _LoraNormLinear(torch.autograd.Function):
    """_NormLinear for a LoRA group (modules/lora_linear.py): the normalised input is not saved but recomputed in
    backward, where the adapters' dA needs it too; saved are the norm's input, rstd, x·A and any dropout seeds."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, eps, offset, gemma, group, *params):
        x2, res2 = row_view(x), None if residual is None else row_view(residual)
        y, r, _, rstd = norm_forward(x2, res2, norm_weight, None, eps, offset, center=False, gemma=gemma)
        out = y.new_empty((*x.shape[:-1], group.rows[-1][1]))
        xa, draws, norms = core_forward(y, group, list(params), out.view(-1, out.shape[-1]))
        del y
        ctx.save_for_backward(x2 if r is None else r, rstd, norm_weight, xa, *params)
        ctx.group, ctx.draws, ctx.norms, ctx.eps, ctx.offset, ctx.gemma = group, draws, norms, eps, offset, gemma
        ctx.x_shape, ctx.residual_dtype = x.shape, None if residual is None else residual.dtype
        return out if r is None else (out, r.view(x.shape))

    @staticmethod
    def backward(ctx, dout, dres=None):
        xs, rstd, norm_weight, xa, *params = ctx.saved_tensors
        dout2 = dout.reshape(-1, dout.shape[-1])
        g = dora_scaled_grad(dout2, ctx.group, params, ctx.norms)
        w = backward_weight(ctx.group, g.dtype)
        dy, dxs, dBs = core_backward_input(g, ctx.group, params, xa, ctx.draws, True, w)
        dAs, dMs = [], []
        if dxs:
            y = norm_forward(xs, None, norm_weight, None, ctx.eps, ctx.offset, center=False, gemma=ctx.gemma)[0]
            dAs = core_backward_A(dxs, y, ctx.group, params, ctx.draws)
            dMs = core_backward_magnitude(dout2, y, ctx.group, params, xa, ctx.norms, w)
            del y
        dx, dnw, _ = norm_backward(dy, xs, norm_weight, None, rstd, None if dres is None else row_view(dres),
                                   ctx.offset, center=False, gemma=ctx.gemma, need_dw=ctx.needs_input_grad[2],
                                   need_db=False)
        dx = dx.view(ctx.x_shape)
        dr = dx.to(ctx.residual_dtype) if ctx.residual_dtype is not None and ctx.needs_input_grad[1] else None
        return (dx, dr, dnw, None, None, None, None, *dAs, *dBs, *dMs)


class _LoraGatedDown(torch.autograd.Function):
    """_GatedDown with down_proj a LoraLinear: the adapters' dX joins dact before the activation's backward, whose
    recomputed product (written over dact) then gives dA; gate_up, x·A and any dropout seed are saved."""

    @staticmethod
    def forward(ctx, gate_up, activation, group, *params):
        gu2d = row_view(gate_up)
        half = gu2d.shape[1] // 2
        act = torch.empty((gu2d.shape[0], half), dtype=gu2d.dtype, device=gu2d.device)
        if act.numel():
            gated_forward(gu2d[:, :half], gu2d[:, half:], act, activation)
        out = torch.empty((*gate_up.shape[:-1], group.rows[-1][1]), dtype=act.dtype, device=act.device)
        xa, draws, norms = core_forward(act, group, list(params), out.view(-1, out.shape[-1]))
        del act
        ctx.inplace = owns_memory(gate_up, gu2d, 2 * half)
        ctx.save_for_backward(gu2d, xa, *params)
        ctx.activation, ctx.group, ctx.draws, ctx.norms, ctx.shape = activation, group, draws, norms, gate_up.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        gu2d, xa, *params = ctx.saved_tensors
        half = gu2d.shape[1] // 2
        dout2 = dout.reshape(-1, dout.shape[-1])
        g = dora_scaled_grad(dout2, ctx.group, params, ctx.norms)
        w = backward_weight(ctx.group, g.dtype)
        dact, dxs, dBs = core_backward_input(g, ctx.group, params, xa, ctx.draws, True, w)
        dgu = gu2d if ctx.inplace else torch.empty_like(gu2d)
        if dact.numel():  # d gate_up, and the product written over dact for dA
            gated_backward(dact, gu2d[:, :half], gu2d[:, half:], dgu[:, :half], dgu[:, half:], ctx.activation,
                           product2d=dact if dxs else None)
        if ctx.inplace:
            increment_version(gu2d)
        dAs = core_backward_A(dxs, dact, ctx.group, params, ctx.draws)
        dMs = core_backward_magnitude(dout2, dact, ctx.group, params, xa, ctx.norms, w)
        return (dgu.view(ctx.shape), None, None, *dAs, *dBs, *dMs)


def _norm_linear_forward(x, residual, norm_weight, weights, biases, eps, offset, gemma):
    """(out (..., sum rows), the norm's input as rows, r (rows) or None, rstd)."""
    x2, res2 = row_view(x), None if residual is None else row_view(residual)
    y, r, _, rstd = norm_forward(x2, res2, norm_weight, None, eps, offset, center=False, gemma=gemma)
    w = _stacked(weights)
    # Written through ``out=`` so the result is a base tensor, not a view made inside a custom Function (rope
    # rotates q and k in place in it; see linear.py). y is dropped after the GEMM: the backward recomputes it.
    out = y.new_empty((*x.shape[:-1], w.shape[0]))
    if biases:
        torch.addmm(_stacked(biases), y, w.t(), out=out.view(-1, w.shape[0]))
    else:
        torch.mm(y, w.t(), out=out.view(-1, w.shape[0]))
    return out, x2 if r is None else r, r, rstd


def _norm_linear_backward(dout, dres, xs, rstd, norm_weight, weights, eps, offset, gemma, need_dws: bool,
                          need_dnw: bool, has_bias: bool):
    """(dx (rows), d norm weight or None, the stacked dW or None, the stacked dB or None)."""
    g = dout.reshape(-1, dout.shape[-1])  # (N, sum rows)
    dw = None
    if need_dws:
        y = norm_forward(xs, None, norm_weight, None, eps, offset, center=False, gemma=gemma)[0]
        dw = g.t() @ y
        del y
    db = g.sum(0) if has_bias else None
    dy = g @ _stacked(weights)  # (N, H)
    dx, dnw, _ = norm_backward(dy, xs, norm_weight, None, rstd, None if dres is None else row_view(dres), offset,
                               center=False, gemma=gemma, need_dw=need_dnw, need_db=False)
    return dx, dnw, dw, db


class _GatedDown(torch.autograd.Function):
    """down(act(gate) * up) from gate_up (..., 2I); saves gate_up only, recomputes the product in backward."""

    @staticmethod
    def forward(ctx, gate_up, activation, weight, bias):
        gu2d = row_view(gate_up)
        out = _gated_down_forward(gu2d, activation, weight, bias, gate_up.shape[:-1])
        ctx.inplace = owns_memory(gate_up, gu2d, 2 * (gu2d.shape[1] // 2))
        ctx.save_for_backward(gu2d, weight)
        ctx.activation, ctx.has_bias, ctx.shape = activation, bias is not None, gate_up.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        gu2d, weight = ctx.saved_tensors
        dgu, dw, db = _gated_down_backward(dout, gu2d, weight, ctx.activation, ctx.needs_input_grad[0],
                                           ctx.needs_input_grad[2], ctx.has_bias, ctx.inplace)
        return None if dgu is None else dgu.view(ctx.shape), None, dw, db


def _gated_down_forward(gu2d: torch.Tensor, activation: str, weight: torch.Tensor, bias: torch.Tensor | None,
                        lead_shape: torch.Size) -> torch.Tensor:
    half = gu2d.shape[1] // 2
    act = torch.empty((gu2d.shape[0], half), dtype=gu2d.dtype, device=gu2d.device)
    if act.numel():
        gated_forward(gu2d[:, :half], gu2d[:, half:], act, activation)
    # Written straight into the (..., H) result: a .view of a 2-D product would make the layer's output a view,
    # which FSDP2 warns about (an in-place op on it would drop its pre-backward hook).
    out = torch.empty((*lead_shape, weight.shape[0]), dtype=act.dtype, device=act.device)
    if bias is None:
        torch.mm(act, weight.t(), out=out.view(-1, weight.shape[0]))
    else:
        torch.addmm(bias, act, weight.t(), out=out.view(-1, weight.shape[0]))
    return out


def _gated_down_backward(dout, gu2d, weight, activation: str, need_dgu: bool, need_dw: bool, has_bias: bool,
                         inplace: bool):
    """(d gate_up (rows, 2I) or None, dW or None, dB or None); d gate_up goes over gu2d's memory when inplace."""
    half = gu2d.shape[1] // 2
    gate, up = gu2d[:, :half], gu2d[:, half:]
    g = dout.reshape(-1, dout.shape[-1])  # (N, H)
    db = g.sum(0) if has_bias else None
    dw = dgu = None
    if need_dgu:
        dact = g @ weight  # (N, I)
        dgu = gu2d if inplace else torch.empty_like(gu2d)
        # One pass: d gate_up (over gate_up's memory when owned) and, for dW, the product over dact.
        if dact.numel():
            gated_backward(dact, gate, up, dgu[:, :half], dgu[:, half:], activation,
                           product2d=dact if need_dw else None)
        if inplace:
            increment_version(gu2d)
        if need_dw:
            dw = g.t() @ dact
        del dact
    elif need_dw:
        act = torch.empty((gu2d.shape[0], half), dtype=gu2d.dtype, device=gu2d.device)
        if act.numel():
            gated_forward(gate, up, act, activation)
        dw = g.t() @ act
    return dgu, dw, db


# ---- the same two paths as custom ops, for torch.compile (liger_models/kernels/_custom_ops.py) ----------------------

@custom_op("norm_linear")
def _norm_linear_op(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor,
                    weights: list[torch.Tensor], biases: list[torch.Tensor], eps: float, offset: float,
                    gemma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_NormLinear's forward: (out, r in x's shape or a placeholder, rstd)."""
    out, _, r, rstd = _norm_linear_forward(x, residual, norm_weight, weights, biases, eps, offset, gemma)
    return out, absent(x) if r is None else r.view(x.shape), rstd


@_norm_linear_op.register_fake
def _(x, residual, norm_weight, weights, biases, eps, offset, gemma):
    out = x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))
    r = absent(x) if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, r, x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@custom_op("norm_linear_backward")
def _norm_linear_backward_op(dout: torch.Tensor, dres: Optional[torch.Tensor], xs: torch.Tensor, rstd: torch.Tensor,
                             norm_weight: torch.Tensor, weights: list[torch.Tensor], eps: float, offset: float,
                             gemma: bool, need_dws: bool, need_dnw: bool,
                             has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in xs's shape, d norm weight, the stacked dW, the stacked dB), placeholders for what was not asked for.
    The stacked gradients are split outside: an op's outputs may not be views of one another."""
    dx, dnw, dw, db = _norm_linear_backward(dout, dres, row_view(xs), rstd, norm_weight, weights, eps, offset, gemma,
                                            need_dws, need_dnw, has_bias)
    return (dx.view(xs.shape), absent(xs) if dnw is None else dnw, absent(xs) if dw is None else dw,
            absent(xs) if db is None else db)


@_norm_linear_backward_op.register_fake
def _(dout, dres, xs, rstd, norm_weight, weights, eps, offset, gemma, need_dws, need_dnw, has_bias):
    rows = dout.shape[-1]
    return (torch.empty(xs.shape, dtype=xs.dtype, device=xs.device),
            torch.empty_like(norm_weight) if need_dnw else absent(xs),
            xs.new_empty((rows, xs.shape[-1]), dtype=dout.dtype) if need_dws else absent(xs),
            dout.new_empty(rows) if has_bias else absent(xs))


def _norm_linear_setup(ctx, inputs, output) -> None:
    x, residual, norm_weight, weights, biases, ctx.eps, ctx.offset, ctx.gemma = inputs
    _, r, rstd = output
    ctx.save_for_backward(x if residual is None else r, rstd, norm_weight, *weights)
    ctx.rows, ctx.has_bias = [w.shape[0] for w in weights], bool(biases)
    ctx.residual_dtype = None if residual is None else residual.dtype
    ctx.mark_non_differentiable(rstd)


def _norm_linear_grads(ctx, dout, dres, _drstd):
    refuse_double_backward("norm_linear")
    xs, rstd, norm_weight, *weights = ctx.saved_tensors
    need_dws = any(ctx.needs_input_grad[3])
    if ctx.residual_dtype is None:
        dres = None  # the gradient of r's placeholder
    dx, dnw, dw, db = _norm_linear_backward_op(dout, dres, xs, rstd, norm_weight, weights, ctx.eps, ctx.offset,
                                               ctx.gemma, need_dws, ctx.needs_input_grad[2], ctx.has_bias)
    # A list input takes a list of gradients, one per tensor.
    dws = list(dw.split(ctx.rows)) if need_dws else [None] * len(ctx.rows)
    dbs = list(db.split(ctx.rows)) if ctx.has_bias else []
    dr = dx.to(ctx.residual_dtype) if ctx.residual_dtype is not None and ctx.needs_input_grad[1] else None
    return dx, dr, dnw if ctx.needs_input_grad[2] else None, dws, dbs, None, None, None


_norm_linear_op.register_autograd(_norm_linear_grads, setup_context=_norm_linear_setup)


@custom_op("gated_down")
def _gated_down_op(gate_up: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   activation: str) -> torch.Tensor:
    """_GatedDown's forward."""
    return _gated_down_forward(row_view(gate_up), activation, weight, bias, gate_up.shape[:-1])


@_gated_down_op.register_fake
def _(gate_up, weight, bias, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))


@custom_op("gated_down_backward")
def _gated_down_backward_op(dout: torch.Tensor, gate_up: torch.Tensor, weight: torch.Tensor, activation: str,
                            need_dgu: bool, need_dw: bool,
                            has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d gate_up, dW, dB), placeholders for what was not asked for. d gate_up is a fresh tensor: an op may not
    write over its input gate_up as the eager backward does; the product still goes over d act's memory."""
    dgu, dw, db = _gated_down_backward(dout, row_view(gate_up), weight, activation, need_dgu, need_dw, has_bias,
                                       inplace=False)
    return (absent(gate_up) if dgu is None else dgu.view(gate_up.shape), absent(weight) if dw is None else dw,
            absent(weight) if db is None else db)


@_gated_down_backward_op.register_fake
def _(dout, gate_up, weight, activation, need_dgu, need_dw, has_bias):
    return (torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device) if need_dgu else absent(gate_up),
            torch.empty_like(weight) if need_dw else absent(weight),
            dout.new_empty(weight.shape[0]) if has_bias else absent(weight))


def _gated_down_setup(ctx, inputs, output) -> None:
    gate_up, weight, bias, ctx.activation = inputs
    ctx.save_for_backward(gate_up, weight)
    ctx.has_bias = bias is not None


def _gated_down_grads(ctx, dout):
    refuse_double_backward("gated_down")
    gate_up, weight = ctx.saved_tensors
    need_dgu, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dgu, dw, db = _gated_down_backward_op(dout, gate_up, weight, ctx.activation, need_dgu, need_dw, ctx.has_bias)
    return dgu if need_dgu else None, dw if need_dw else None, db if ctx.has_bias else None, None


_gated_down_op.register_autograd(_gated_down_grads, setup_context=_gated_down_setup)


def _fusable(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and use_triton(x) and not torch.is_autocast_enabled(x.device.type)


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm(x + residual), x + residual`` with the sum in the wider of the two dtypes, as HF's ``residual + h``.

    Under autocast a block's output x comes out of a bf16 GEMM while the stream (from the float32 embeddings) is
    float32; the fused add would round the stream to x's dtype at every layer, HF keeps it in float32."""
    if x.dtype != residual.dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    return norm(x, residual)


def norm_linear(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor]:
    """``h, stream = norm(x [, residual]); return cat([l(h) for l in linears], -1), stream`` (stream = x without a
    residual), saving for backward only the stream and rstd where the fused path applies."""
    if (is_lora_group(linears) and _fusable(x) and frozen_bases(linears)
            and not torch.compiler.is_compiling()):
        group = Group(linears)
        result = _LoraNormLinear.apply(x, residual, norm.weight, float(norm.eps), float(norm.offset),
                                       norm.casting == "gemma", group, *group.adapter_params())
        return (result, x) if residual is None else result
    if not _fusable(x) or not all_plain(linears):  # a wrapped projection (PEFT's LoRA) runs its own forward
        h, stream = (norm(x), x) if residual is None else add_norm(norm, x, residual)
        return packed_linear(h, linears), stream
    if torch.compiler.is_compiling():  # the custom op, which dynamo traces
        biases = [lin.bias for lin in linears] if linears[0].bias is not None else []
        out, r, _ = _norm_linear_op(x, residual, norm.weight, [lin.weight for lin in linears], biases,
                                    float(norm.eps), float(norm.offset), norm.casting == "gemma")
        return out, x if residual is None else r
    params = [lin.weight for lin in linears] + ([lin.bias for lin in linears] if linears[0].bias is not None else [])
    result = _NormLinear.apply(x, residual, norm.weight, float(norm.eps), float(norm.offset),
                               norm.casting == "gemma", len(linears), *params)
    return (result, x) if residual is None else result


def gated_down(gate_up: torch.Tensor, activation: str, down: nn.Linear) -> torch.Tensor:
    """``down(act(gate) * up)`` for gate_up (..., 2I) = [gate | up]; the product is never saved for backward."""
    if (is_lora_group([down]) and _fusable(gate_up) and frozen_bases([down])
            and not torch.compiler.is_compiling()):
        group = Group([down])
        return _LoraGatedDown.apply(gate_up, activation, group, *group.adapter_params())
    # Under autocast nn.Linear picks the GEMM dtype; a wrapped or hooked projection must run its own forward.
    if torch.is_autocast_enabled(gate_up.device.type) or not is_plain_linear(down):
        return down(gated_mlp_packed(gate_up, activation))
    if torch.compiler.is_compiling():
        return _gated_down_op(gate_up, down.weight, down.bias, activation)
    return _GatedDown.apply(gate_up, activation, down.weight, down.bias)
