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

import torch
from torch import nn
from torch.autograd.graph import increment_version

from liger_models.kernels._dispatch import row_view, use_triton
from liger_models.kernels.gated_mlp import gated_backward, gated_forward, owns_memory
from liger_models.kernels.gated_mlp import gated_mlp_packed
from liger_models.kernels.rms_norm import RMSNorm, norm_backward, norm_forward

from .linear import _stacked, all_plain, is_plain_linear, packed_linear


class _NormLinear(torch.autograd.Function):
    """(x [+ residual]) → RMSNorm → one GEMM against the stacked weights; saves the norm's input and rstd only."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, eps, offset, gemma, n, *params):
        weights, biases = list(params[:n]), list(params[n:])
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
        ctx.save_for_backward(x2 if r is None else r, rstd, norm_weight, *weights)
        ctx.n, ctx.has_bias, ctx.rows = n, bool(biases), [wt.shape[0] for wt in weights]
        ctx.eps, ctx.offset, ctx.gemma = eps, offset, gemma
        ctx.x_shape, ctx.residual_dtype = x.shape, None if residual is None else residual.dtype
        return out if r is None else (out, r.view(x.shape))

    @staticmethod
    def backward(ctx, dout, dres=None):
        xs, rstd, norm_weight, *weights = ctx.saved_tensors
        g = dout.reshape(-1, dout.shape[-1])  # (N, sum rows)
        dws = [None] * ctx.n
        if any(ctx.needs_input_grad[7 : 7 + ctx.n]):
            y = norm_forward(xs, None, norm_weight, None, ctx.eps, ctx.offset, center=False, gemma=ctx.gemma)[0]
            dws = list((g.t() @ y).split(ctx.rows))  # one GEMM, sliced per weight
            del y
        dbs = list(g.sum(0).split(ctx.rows)) if ctx.has_bias else []
        dy = g @ _stacked(weights)  # (N, H)
        dx, dnw, _ = norm_backward(dy, xs, norm_weight, None, rstd, None if dres is None else row_view(dres),
                                   ctx.offset, center=False, gemma=ctx.gemma, need_dw=ctx.needs_input_grad[2],
                                   need_db=False)
        dx = dx.view(ctx.x_shape)
        dr = dx.to(ctx.residual_dtype) if ctx.residual_dtype is not None and ctx.needs_input_grad[1] else None
        return (dx, dr, dnw, None, None, None, None, *dws, *dbs)


class _GatedDown(torch.autograd.Function):
    """down(act(gate) * up) from gate_up (..., 2I); saves gate_up only, recomputes the product in backward."""

    @staticmethod
    def forward(ctx, gate_up, activation, weight, bias):
        gu2d = row_view(gate_up)
        half = gu2d.shape[1] // 2
        act = torch.empty((gu2d.shape[0], half), dtype=gu2d.dtype, device=gu2d.device)
        if act.numel():
            gated_forward(gu2d[:, :half], gu2d[:, half:], act, activation)
        # Written straight into the (..., H) result: a .view of a 2-D product would make the layer's output a view,
        # which FSDP2 warns about (an in-place op on it would drop its pre-backward hook).
        out = torch.empty((*gate_up.shape[:-1], weight.shape[0]), dtype=act.dtype, device=act.device)
        if bias is None:
            torch.mm(act, weight.t(), out=out.view(-1, weight.shape[0]))
        else:
            torch.addmm(bias, act, weight.t(), out=out.view(-1, weight.shape[0]))
        ctx.inplace = owns_memory(gate_up, gu2d, 2 * half)
        ctx.save_for_backward(gu2d, weight)
        ctx.activation, ctx.has_bias, ctx.shape = activation, bias is not None, gate_up.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        gu2d, weight = ctx.saved_tensors
        half = gu2d.shape[1] // 2
        gate, up = gu2d[:, :half], gu2d[:, half:]
        g = dout.reshape(-1, dout.shape[-1])  # (N, H)
        need_dgu, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        db = g.sum(0) if ctx.has_bias else None
        dw = dgu = None
        if need_dgu:
            dact = g @ weight  # (N, I)
            dgu = gu2d if ctx.inplace else torch.empty_like(gu2d)
            # One pass: d gate_up (over gate_up's memory when owned) and, for dW, the product over dact.
            if dact.numel():
                gated_backward(dact, gate, up, dgu[:, :half], dgu[:, half:], ctx.activation,
                               product2d=dact if need_dw else None)
            if ctx.inplace:
                increment_version(gu2d)
            dgu = dgu.view(ctx.shape)
            if need_dw:
                dw = g.t() @ dact
            del dact
        elif need_dw:
            act = torch.empty((gu2d.shape[0], half), dtype=gu2d.dtype, device=gu2d.device)
            if act.numel():
                gated_forward(gate, up, act, ctx.activation)
            dw = g.t() @ act
        return dgu, None, dw, db


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


@torch.compiler.disable  # opaque to torch.compile: one clean graph break (dynamo cannot trace Triton launches)
def norm_linear(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor]:
    """``h, stream = norm(x [, residual]); return cat([l(h) for l in linears], -1), stream`` (stream = x without a
    residual), saving for backward only the stream and rstd where the fused path applies."""
    if not _fusable(x) or not all_plain(linears):  # a wrapped projection (PEFT's LoRA) runs its own forward
        h, stream = (norm(x), x) if residual is None else add_norm(norm, x, residual)
        return packed_linear(h, linears), stream
    params = [lin.weight for lin in linears] + ([lin.bias for lin in linears] if linears[0].bias is not None else [])
    result = _NormLinear.apply(x, residual, norm.weight, float(norm.eps), float(norm.offset),
                               norm.casting == "gemma", len(linears), *params)
    return (result, x) if residual is None else result


@torch.compiler.disable  # opaque to torch.compile: one clean graph break (dynamo cannot trace Triton launches)
def gated_down(gate_up: torch.Tensor, activation: str, down: nn.Linear) -> torch.Tensor:
    """``down(act(gate) * up)`` for gate_up (..., 2I) = [gate | up]; the product is never saved for backward."""
    # Under autocast nn.Linear picks the GEMM dtype; a wrapped or hooked projection must run its own forward.
    if torch.is_autocast_enabled(gate_up.device.type) or not is_plain_linear(down):
        return down(gated_mlp_packed(gate_up, activation))
    return _GatedDown.apply(gate_up, activation, down.weight, down.bias)
