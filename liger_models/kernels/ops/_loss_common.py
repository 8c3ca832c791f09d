"""What the two loss Functions share besides the row kernel (_ce_core.py): option checks, the in-place scaling of a
gradient computed in the forward by backward's grad_output, handing such gradients out exactly once, and the two
per-token options computed around the kernel (predicted tokens, token scaling)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._ce_core import ce_rows
from .._launch import cdiv, launch, sm_count


@dataclass(frozen=True)
class LossScaleTuning:
    """Launch and schedule settings (liger_models/kernels/_tuning.py: ``tuned(module, field=value)`` overrides)."""

    scale_block: int = 4096
    # scaled_sum: one round trip for 8192 losses (6.3 µs at 2048 over 4 warps)
    sum_block: int = 8192
    sum_warps: int = 16
    scale_programs_per_sm: int = 8  # scale_'s grid: enough resident programs to stream at the copy rate when g != 1
    argmax_slab_bytes: int = 64 << 20  # predicted_tokens with a softcap: the fp32 capped copy, this much at a time


TUNING = LossScaleTuning()

_REDUCTIONS = ("mean", "sum", "none")


def check_options(reduction: str, label_smoothing: float, softcap: float | None, z_loss: float = 0.0,
                  normalizer: float | torch.Tensor | None = None) -> None:
    """Raise ValueError for an unknown reduction, an out-of-range smoothing / softcap / z-loss, or a normaliser that
    is not one number ≥ 0 (a tensor's value is not read: that would stall the GPU; only its size is checked) or comes
    with a reduction other than "mean"."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not 0 < softcap < math.inf:  # inf: inf·tanh(x/inf) = inf·0, a NaN loss
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")
    if not 0.0 <= z_loss < math.inf:  # a negative z-loss rewards a growing log-partition without bound
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:  # one count; a (1,)-shaped one is used as 0-dim (mean_denominator)
            raise ValueError(f"normalizer must be one number, got a tensor of shape {tuple(normalizer.shape)}")
    elif normalizer is not None and not 0 <= normalizer < math.inf:  # 0 is all-ignored: counts as 1, loss 0
        raise ValueError(f"normalizer must be a finite count >= 0 or None, got {normalizer}")
    if normalizer is not None and reduction != "mean":  # it divides the mean's sum; anywhere else it went unused
        raise ValueError(f"normalizer divides reduction='mean''s sum; with reduction={reduction!r} it would be "
                         "ignored (pass reduction='mean', or divide the result yourself)")


@triton.jit
def _scale_kernel(X, G, n, n_cols, stride_row, BLOCK: tl.constexpr, ROW_STRIDED: tl.constexpr):
    # g is read on the device: grad_output == 1 (a plain loss.backward()) costs a launch and no traffic. A small
    # grid that strides over x: one program per 4096 elements made the no-op cost 0.18 ms at 8192×128256 (256K
    # programs to schedule; H200, 2026-11-30). A while loop: the interpreter cannot `for` to a runtime bound.
    # ROW_STRIDED: x is (n / n_cols, n_cols) rows stride_row apart (an in-place gradient in a slice of wider logits).
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        while start < n:
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            if ROW_STRIDED:
                offs = (offs // n_cols) * stride_row + offs % n_cols
            x = tl.load(X + offs, mask=mask).to(tl.float32)
            tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=mask)
            start += step


@triton.jit
def _scaled_sum_kernel(X, G, OUT, n, BLOCK: tl.constexpr):
    # One program, a fixed order: the same bits every call. A while loop: as in _scale_kernel.
    acc = tl.zeros([BLOCK], tl.float32)
    start = tl.full((), 0, tl.int64)
    while start < n:
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0)
        start += BLOCK
    tl.store(OUT, tl.sum(acc, 0) * tl.load(G))


def scaled_sum(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g · Σ x as a 0-dim fp32 tensor for a contiguous fp32 x (per-token losses) and a 0-dim fp32 device tensor g.

    On CUDA one launch where ``x.sum() * g`` takes two (torch's reduction and a multiply, ~7 µs of stream time after
    the loss kernel on the H200; benchmarks/tools/gpu_timeline.py). On the CPU PyTorch's sum: the interpreter would
    spend ~9 ms simulating the launch for nothing (tests call the kernel through _launch_scaled_sum)."""
    return _launch_scaled_sum(x, g) if x.is_cuda else x.sum() * g


def _launch_scaled_sum(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    out = torch.empty((), dtype=torch.float32, device=x.device)
    launch(_scaled_sum_kernel, (1,), [x, g, out, x.numel()], dict(BLOCK=TUNING.sum_block, num_warps=TUNING.sum_warps))
    return out


def take_grads(ctx) -> tuple:
    """The gradients a forward pass computed, handed out once.

    A second backward through the same graph (retain_graph=True) would scale them again, and autograd may already
    hold them as some leaf's .grad, so it raises instead.
    """
    grads = ctx.grads
    if grads is None:
        raise RuntimeError("this loss computes its gradients in the forward pass: backward can run only once per "
                           "forward (retain_graph=True is not supported)")
    ctx.grads = None
    return grads


def scale_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x *= g in place for a 1-element device tensor g, skipping all traffic when g == 1; x contiguous, or 2-D with
    a unit column stride (rows apart by their stride: cross_entropy's in-place gradient in a slice of the logits)."""
    n = x.numel()
    if not n:
        return x
    strided = not x.is_contiguous()
    if strided and (x.dim() != 2 or x.stride(1) != 1):
        raise ValueError(f"scale_ needs a contiguous or row-strided 2-D tensor, got strides {x.stride()}")
    n_cols, stride_row = (x.shape[1], x.stride(0)) if strided else (1, 1)
    launch(_scale_kernel, (min(cdiv(n, TUNING.scale_block), TUNING.scale_programs_per_sm * sm_count(x.device)),),
           [x, g.reshape(1).float(), n, n_cols, stride_row],
           dict(BLOCK=TUNING.scale_block, ROW_STRIDED=strided, num_warps=8))
    return x


def scaled(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x · g as ``scale_`` computes it (fp32 product, one rounding to x's dtype), in a fresh tensor: the custom ops'
    backward (_custom_ops.py), which may not write over a tensor saved in the forward."""
    return (x.float() * g.reshape(()).float()).to(x.dtype)


class LossOutput(NamedTuple):
    """What a loss call returns when asked for more than the loss (``return_z_loss`` / ``return_token_accuracy`` /
    ``return_predicted_tokens``).

    loss: as without the extras. z_loss: the z-loss term's share of ``loss`` (already inside it), reduced the same
    way, detached, for logging. token_accuracy: the share of non-ignored tokens whose target is the argmax (ties
    go to the lowest index, as argmax breaks them), a 0-dim fp32 tensor, unweighted. target_rank: per-token ranks
    (0 = top-1; -1 where ignored) when asked for with ``return_target_rank``. predicted_tokens: per-token argmax of
    the logits the loss sees (soft-capped, when a softcap is set), int64 of labels' shape, the lowest index among
    tied maxima, -1 where ignored. Unrequested fields are None. New fields are added at the end, so the earlier
    ones keep their positions.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    target_rank: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def predicted_tokens(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, softcap: float | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """LossOutput.predicted_tokens of logits (rows, V) and labels (rows,), into out (rows,) int64 when given.

    Ties go to the lowest index (torch.argmax's documented rule, and Liger-Kernel's). With a softcap the argmax is
    taken over c·tanh(x/c) in fp32, as the loss computes it: the cap is monotonic, but it saturates, so logits far
    past it that differ can tie once capped, and the lowest of those indices is the prediction (as for the target's
    rank). That costs an fp32 copy, made TUNING.argmax_slab_bytes of rows at a time so that a chunk of linear-CE's
    logits scratch (up to grad_W's bytes) is not doubled. No host sync."""
    rows = logits.shape[0]
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if softcap is None:
        torch.argmax(logits, -1, out=out)
    else:
        step = max(1, TUNING.argmax_slab_bytes // (4 * logits.shape[1]))
        for s in range(0, rows, step):
            capped = softcap * torch.tanh(logits[s : s + step].float() / softcap)
            torch.argmax(capped, -1, out=out[s : s + step])
    return out.masked_fill_(labels == ignore_index, -1)


def token_scaled_rows(logits: torch.Tensor, labels: torch.Tensor, *, grad: torch.Tensor | None, loss: torch.Tensor,
                      lse: torch.Tensor, q: torch.Tensor, rank: torch.Tensor | None, scale: torch.Tensor | None,
                      p: torch.Tensor, ignore_index: int, softcap: float | None, **opts) -> torch.Tensor | None:
    """`ce_rows` (_ce_core.py) for use_token_scaling: each row's loss and gradient times its target probability
    p_t = softmax(capped logits)[t], which is a constant (no gradient flows through it).

    Pass 1 alone (loss, lse, q, rank), then p_t = exp(cap(x_t) − lse) in fp32 into p (rows,) (0 where ignored;
    exp of a difference keeps a tiny p_t's relative precision, which 1 − q would not), then, when grad is given,
    pass 2 alone with each row's gradient scale times p_t. x_t is read before pass 2, which may write the gradient
    over the logits. The losses are left unscaled: callers fold p into their per-row scale, which also scales the
    z-loss term and reduction "none"'s deferred gradient. Returns the gradient's row scale (scale · p), None
    without grad. The kernel's one-launch mode is out of reach here, since p_t scales the gradient and is known only
    after pass 1: pass 2 re-reads each row from memory rather than partly from L2."""
    opts = dict(opts, ignore_index=ignore_index, softcap=softcap)
    ce_rows(logits, labels, grad=None, loss=loss, lse=lse, q=q, rank=rank, scale=None, **opts)
    valid = labels != ignore_index
    # a clamped index: an out-of-range label must not reach the gather (the label check raises for it afterwards)
    index = torch.where(valid, labels, 0).long().clamp_(0, logits.shape[1] - 1)
    x_t = logits.gather(1, index[:, None])[:, 0].float()
    if softcap is not None:
        x_t = softcap * torch.tanh(x_t / softcap)
    p.copy_(torch.where(valid, torch.exp(x_t - lse), 0.0))
    if grad is None:
        return None
    row_scale = (p * scale).contiguous()
    ce_rows(logits, labels, grad=grad, loss=None, lse=lse, q=q, rank=None, scale=row_scale, **opts)
    return row_scale


def check_class_weights(class_weights: torch.Tensor | None, vocab: int, device: torch.device) -> None:
    """class_weights: one fp weight per vocabulary entry on the logits' device."""
    if class_weights is None:
        return
    if not isinstance(class_weights, torch.Tensor) or class_weights.shape != (vocab,):
        shape = tuple(class_weights.shape) if isinstance(class_weights, torch.Tensor) else type(class_weights)
        raise ValueError(f"class_weights must be a ({vocab},) tensor, one weight per class, got {shape}")
    if not class_weights.dtype.is_floating_point:
        raise ValueError(f"class_weights must be floating point, got {class_weights.dtype}")
    if class_weights.device != device:
        raise ValueError(f"class_weights is on {class_weights.device}, the logits' operands on {device}")


def row_weights(labels: torch.Tensor, class_weights: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """fp32 (N,) weight of each token's target (0 where ignored). An out-of-range label reads a clamped class here;
    the label check raises for it before the loss is used."""
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0).clamp(0, class_weights.shape[0] - 1)
    return torch.where(valid, class_weights.float()[target], 0.0)


def weighted_scale(row_w: torch.Tensor, reduction: str, normalizer, loss_scale: float,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """d(loss)/d(per-token loss) per row for mean / sum with class weights: torch's weighted mean divides by the sum
    of the targets' weights row_w (a normaliser, when given, replaces it). rows: the per-row factor of that scale
    (default row_w itself)."""
    scale = (row_w if rows is None else rows) * loss_scale
    if reduction != "mean":
        return scale
    if normalizer is None:
        denom = row_w.sum()
    else:
        denom = torch.as_tensor(normalizer, device=row_w.device).reshape(()).float()
    return scale / torch.where(denom == 0, torch.ones_like(denom), denom)


def row_kernel_options(ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None,
                       label_flag: torch.Tensor, class_weights: torch.Tensor | None) -> dict:
    """The row kernel's options (ce_rows' keywords): the class weights go in only where it weighs its rows itself
    (with label smoothing: class_weight_scales)."""
    return dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                label_flag=label_flag, class_smoothing=class_weights if label_smoothing else None)


def class_weight_scales(labels: torch.Tensor, class_weights: torch.Tensor, ignore_index: int, reduction: str,
                        normalizer, loss_scale: float, label_smoothing: float):
    """With class weights: (the per-row factor of the row kernel's losses and gradients, d(loss)/d(the kernel's
    per-row loss) per row for mean / sum, None for "none").

    Without smoothing the kernel's rows are unweighted and the factor is each target's class weight w_t. Label
    smoothing weighs every class (ε/V·Σ_j w_j·(lse − x_j), torch's rule), which no per-row factor can do: the kernel
    then weighs its rows itself (ce_rows' class_smoothing), the factor is None, and the mean still divides by the
    targets' weights (every non-ignored row counts, a target of weight 0 too: its smoothing term remains)."""
    flat = labels.reshape(-1)
    row_w = row_weights(flat, class_weights, ignore_index)
    if not label_smoothing:
        return row_w, None if reduction == "none" else weighted_scale(row_w, reduction, normalizer, loss_scale)
    if reduction == "none":
        return None, None
    return None, weighted_scale(row_w, reduction, normalizer, loss_scale, rows=(flat != ignore_index).float())


def token_accuracy(rank: torch.Tensor) -> torch.Tensor:
    """Share of ranked (non-ignored) tokens at rank 0; 0 when every token is ignored. No host sync."""
    valid = rank >= 0
    return (rank == 0).sum().float() / valid.sum().clamp(min=1).float()


def z_loss_term(lse: torch.Tensor, valid: torch.Tensor, z_loss: float, scale: torch.Tensor | float,
                reduction: str, shape: torch.Size) -> torch.Tensor:
    """The z-loss part of the loss (z · lse² per token, times the same per-token scale), reduced like the loss."""
    z = torch.where(valid, z_loss * lse.float().square(), 0.0) * scale
    return z.reshape(shape) if reduction == "none" else z.sum()
