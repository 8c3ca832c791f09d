"""Cross-entropy on materialised logits: online softmax, one pass, gradient written in place.

Math per row x (length V, fp32 whatever the input dtype), target t, ε = label_smoothing, z = z_loss:
  softcap c:  x ← c·tanh(x / c)                         (Gemma-2 final-logit soft-capping)
  lse = log Σ_j exp(x_j)
  loss = (1−ε)·(lse − x_t) + ε·(lse − mean_j x_j) + z·lse²     (PyTorch / HF label smoothing: ε spread as ε/V)
  dloss/dx_j = p_j·(1 + 2z·lse) − ε/V − (1−ε)·[j = t]        (× (1 − tanh²(x_j/c)) through the softcap)
Rows whose label is ignore_index contribute 0 to the loss and get a zero gradient. reduction="mean" divides the
sum by `normalizer` when given (the global count of non-ignored tokens, for gradient accumulation / data
parallelism) or else by the local count; a zero denominator counts as 1 (every label ignored → loss 0, no NaN).
class_weights w (V,): each token's loss (z-loss included) times w_t, and the mean divides by Σ w_t over the
non-ignored tokens (torch's F.cross_entropy(weight=w)); a per-row scale of the same kernel pass, so it costs nothing
extra. With label smoothing the smoothing term weighs every class instead, ε/V·Σ_j w_j·(lse − x_j) (torch's rule,
which Liger-Kernel follows): the kernel reads w itself then (one more read of w per row, from L2).
return_z_loss / return_token_accuracy add the z-loss term (for logging; it stays inside the loss) and the top-1 share
to the result (a LossOutput), and return_predicted_tokens each token's argmax (read from the logits before the
gradient may overwrite them).
use_token_scaling: each token's loss (z-loss and class weight included) times its target probability
p_t = softmax(x)[t], a constant (no gradient through it), the mean's denominator unchanged: the loss is
Σ_t p_t·ℓ_t / denominator and each row's gradient p_t·dℓ_t/dx (the DFT loss, TRL's loss_type="dft"; Liger-Kernel
has it on its linear-CE only). It costs the kernel's passes in two launches instead of one (_loss_common's
token_scaled_rows).

HF numerics matched: HF upcasts the logits to fp32 and calls F.cross_entropy; the kernel reads bf16 and does all
math in fp32. Confident predictions keep their target gradient −(1 − p_t) to fp32 relative precision (see
_ce_core.py for the kernel, its bytes and the in-place contract).

Autograd: for mean / sum the forward already writes the gradient (times 1/denominator); backward multiplies it by
grad_output on the device, a no-op kernel when grad_output == 1, so there is no host sync and no second pass for
a plain loss.backward() (any other grad_output costs one read + write, and unless it is a power of two, a second
bf16 rounding of the gradient). For reduction="none" the per-row grad_output is only known in backward, so the forward
reads the logits once for the losses and backward does the gradient pass (same bytes as the fused path).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from ._ce_core import ce_rows
from .._custom_ops import absent, custom_op, refuse_double_backward
from ._loss_common import (LossOutput, check_class_weights, check_options, class_weight_scales, predicted_tokens,
                           row_kernel_options, row_weights, scale_, scaled, scaled_sum, take_grads, token_accuracy,
                           token_scaled_rows, weighted_scale, z_loss_term)
from ._labels import LabelCheck, check_labels, mean_denominator
from .._dispatch import once_differentiable, use_triton
from .._launch import on_input_device

# check_labels: the CUDA-graph trainer checks every batch with it before copying it into the graph's inputs.
__all__ = ["CrossEntropyLoss", "LossOutput", "check_labels", "cross_entropy", "cross_entropy_reference",
           "reduce_loss"]


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
    class_weights: torch.Tensor | None = None,
    use_token_scaling: bool = False,
) -> torch.Tensor:
    """PyTorch cross-entropy with every option of `cross_entropy`; math in fp32 (float64 stays float64)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    x = x.reshape(-1, x.shape[-1])
    flat = labels.reshape(-1)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    valid = flat != ignore_index
    target = torch.where(valid, flat, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = (1.0 - label_smoothing) * (lse - x.gather(-1, target[:, None]).squeeze(-1))
    if z_loss:
        loss = loss + z_loss * lse.square()
    weights = valid
    if class_weights is not None:  # each token's loss times its target's weight; the mean divides by their sum
        weights = torch.where(valid, class_weights.to(x.dtype)[target], 0.0)
        loss = loss * weights
    if label_smoothing:  # ε/V·Σ_j w_j·(lse − x_j): with class weights every class is weighed (w ≡ 1 without)
        w = torch.ones_like(x[0]) if class_weights is None else class_weights.to(x.dtype)
        loss = loss + label_smoothing / x.shape[-1] * (w.sum() * lse - x @ w)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if use_token_scaling:  # times the target's probability, detached; the denominator stays as it is
        loss = loss * target_probability_reference(x, flat, ignore_index)
    out = reduce_loss(loss, weights, reduction, normalizer)
    return out.reshape(labels.shape) if reduction == "none" else out


def target_probability_reference(x: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """use_token_scaling's factor: softmax(x)[target] per row of (capped) logits x (rows, V), detached, 0 where
    ignored."""
    with torch.no_grad():
        valid = labels != ignore_index
        p = torch.softmax(x, -1).gather(-1, torch.where(valid, labels, 0)[:, None])[:, 0]
        return torch.where(valid, p, 0.0)


def loss_extras_reference(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int, z_loss: float,
                          softcap: float | None, reduction: str, normalizer, loss_scale: float = 1.0,
                          class_weights: torch.Tensor | None = None, use_token_scaling: bool = False, want_z: bool,
                          want_accuracy: bool, want_predicted: bool = False):
    """(z-loss term, token accuracy, predicted tokens) of LossOutput in PyTorch, each None unless wanted (the
    reference paths)."""
    with torch.no_grad():
        x = logits.reshape(-1, logits.shape[-1]).float()
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        flat = labels.reshape(-1)
        valid = flat != ignore_index
        z = accuracy = None
        if want_z:
            if class_weights is None:
                denom = mean_denominator(valid, normalizer, torch.float32) if reduction == "mean" else 1.0
                scale = torch.where(valid, loss_scale / torch.as_tensor(denom), 0.0)
            else:
                scale = weighted_scale(row_weights(flat, class_weights, ignore_index), reduction, normalizer,
                                       loss_scale)
            if use_token_scaling:
                scale = scale * target_probability_reference(x, flat, ignore_index)
            z = z_loss_term(torch.logsumexp(x, -1), valid, z_loss, scale, reduction, labels.shape)
        if want_accuracy:
            target = torch.where(valid, flat, 0)[:, None]
            top = x.argmax(-1, keepdim=True)
            rank = torch.where(valid, (top != target).int()[:, 0], -1)  # 0 where the target is the argmax
            accuracy = token_accuracy(rank)
        predicted = None
        if want_predicted:  # argmax of x: the capped logits, in fp32 as the kernels' path takes them
            predicted = predicted_tokens(x, flat, ignore_index, None).reshape(labels.shape)
        return z, accuracy, predicted


def reduce_loss(
    loss: torch.Tensor, valid: torch.Tensor, reduction: str, normalizer: float | torch.Tensor | None
) -> torch.Tensor:
    """Per-token losses (zero at ignored rows) → the requested reduction, without a host sync."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / mean_denominator(valid, normalizer, loss.dtype)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, opts: dict, need_grad: bool, inplace: bool, scale: torch.Tensor | None,
                row_w: torch.Tensor | None, extras: tuple, token_scaling: bool):
        # scale: d loss / d per-token loss for mean / sum (LabelCheck's 0-dim device tensor, or per row with class
        # weights); None for "none", where row_w (class weights per row, or None) scales the per-token losses.
        # extras: (z-loss term wanted, token accuracy wanted, predicted tokens wanted).
        fw = _forward(logits, labels, opts, need_grad, inplace, scale, row_w, extras, token_scaling)
        if fw.grad is not None and fw.inplace and fw.x.data_ptr() == logits.data_ptr():
            torch.autograd.graph.increment_version(logits)  # a node that saved the logits now fails loudly
        ctx.opts, ctx.inplace, ctx.shape, ctx.fused = opts, fw.inplace, logits.shape, fw.grad is not None
        ctx.grads = (fw.grad,)  # a plain attribute, not saved: it may be the logits' own (version-bumped) buffer
        ctx.row_w = fw.row_w
        if need_grad and fw.grad is None:
            ctx.save_for_backward(fw.x, fw.flat, fw.lse, fw.q)
        if not any(extras):
            return fw.out
        z, accuracy, predicted = (fw.out.new_zeros(()) if t is None else t
                                  for t in (fw.z, fw.accuracy, fw.predicted))
        ctx.mark_non_differentiable(z, accuracy, predicted)
        return fw.out, z, accuracy, predicted

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_):
        if ctx.fused:
            (grad,) = take_grads(ctx)
            scale_(grad, grad_out)
        else:  # reduction="none": one read + one write with the per-row grad_output
            x, flat, lse, q = ctx.saved_tensors
            grad = x if ctx.inplace else torch.empty_like(x)
            _deferred_grad(grad_out, x, flat, lse, q, ctx.row_w, ctx.opts, grad)
            if ctx.inplace:
                torch.autograd.graph.increment_version(x)
        return grad.view(ctx.shape), None, None, None, None, None, None, None, None


class _Forward(NamedTuple):
    out: torch.Tensor  # the loss: 0-dim, or per token in labels' shape
    z: torch.Tensor | None  # the z-loss term, token accuracy and predicted tokens, when asked for
    accuracy: torch.Tensor | None
    predicted: torch.Tensor | None
    grad: torch.Tensor | None  # d loss / d logits (rows, V) for mean / sum when a gradient is needed
    row_w: torch.Tensor | None  # "none"'s per-row scale of the deferred gradient: class weights × p_t, or None
    inplace: bool  # whether grad is x's memory
    x: torch.Tensor  # the logits as (rows, V); a private contiguous copy of strided ones
    flat: torch.Tensor
    lse: torch.Tensor
    q: torch.Tensor


def _logit_rows(logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the logits as (rows, V) rows the kernel reads in place, or a contiguous copy of them; whether a copy)."""
    x = logits.reshape(-1, logits.shape[-1])
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        return x.contiguous(), True
    return x, False


def _forward(logits, labels, opts: dict, need_grad: bool, inplace: bool, scale: torch.Tensor | None,
             row_w: torch.Tensor | None, extras: tuple, token_scaling: bool) -> _Forward:
    """_CrossEntropy's forward pass (the Function's and the custom op's)."""
    x, copied = _logit_rows(logits)
    if copied:
        inplace = need_grad  # a private copy: the gradient may always go into it
    flat = labels.reshape(-1)
    loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    lse, q = torch.empty_like(loss), torch.empty_like(loss)
    fused = need_grad and scale is not None
    grad = (x if inplace else torch.empty_like(x)) if fused else None
    want_z, want_accuracy, want_predicted = extras
    rank = torch.empty(x.shape[0], dtype=torch.int32, device=x.device) if want_accuracy else None
    # before the kernel: the gradient may go over the logits
    predicted = (predicted_tokens(x, flat, opts["ignore_index"], opts["softcap"]).reshape(labels.shape)
                 if want_predicted else None)
    if token_scaling:
        p = torch.empty_like(loss)
        token_scaled_rows(x, flat, grad=grad, loss=loss, lse=lse, q=q, rank=rank, scale=scale if fused else None,
                          p=p, **opts)
        row_w = p if row_w is None else row_w * p
        if scale is not None:
            scale = scale * p
    else:
        ce_rows(x, flat, grad=grad, loss=loss, lse=lse, q=q, rank=rank, scale=scale if fused else None, **opts)
    if scale is None:  # ignored rows' losses are 0
        out = (loss if row_w is None else loss * row_w).reshape(labels.shape)
    else:
        out = scaled_sum(loss, scale) if scale.dim() == 0 else (loss * scale).sum()
    z = accuracy = None
    if want_z:
        valid = flat != opts["ignore_index"]
        row_scale = (1.0 if row_w is None else row_w) if scale is None else scale
        if opts["class_smoothing"] is not None:  # the kernel weighed its rows: so is the z-loss term inside them
            row_scale = row_scale * row_weights(flat, opts["class_smoothing"], opts["ignore_index"])
        z = z_loss_term(lse, valid, opts["z_loss"], row_scale, "none" if scale is None else "sum", labels.shape)
    if want_accuracy:
        accuracy = token_accuracy(rank)
    return _Forward(out, z, accuracy, predicted, grad, row_w, inplace, x, flat, lse, q)


def _deferred_grad(grad_out, x, flat, lse, q, row_w, opts: dict, grad: torch.Tensor) -> None:
    """reduction="none"'s gradient pass into grad (rows, V), with the per-row grad_output known now."""
    scale = grad_out.reshape(-1).float()
    scale = (scale if row_w is None else scale * row_w).contiguous()
    ce_rows(x, flat, grad=grad, loss=None, lse=lse, q=q, rank=None, scale=scale, **opts)


def _scales(labels, class_weights, ignore_index: int, reduction: str, normalizer, labels_ok: LabelCheck,
            label_smoothing: float):
    """(per-row class weights or None (also where the kernel weighs the rows itself: _loss_common's
    class_weight_scales), d loss / d per-token loss: None for "none", else LabelCheck's 0-dim scale or one per row
    with class weights)."""
    if class_weights is None:
        return None, None if reduction == "none" else labels_ok.scale
    return class_weight_scales(labels, class_weights, ignore_index, reduction, normalizer, 1.0, label_smoothing)



# ---- the custom ops torch.compile traces (_custom_ops.py) ---------------------------------------------------------

@custom_op("cross_entropy")
def _cross_entropy_op(logits: torch.Tensor, labels: torch.Tensor, normalizer: Optional[torch.Tensor],
                      class_weights: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, z_loss: float,
                      softcap: Optional[float], reduction: str, need_grad: bool, want_z: bool,
                      want_accuracy: bool, use_token_scaling: bool = False, want_predicted: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                 torch.Tensor, torch.Tensor, torch.Tensor]:
    """The triton path of `cross_entropy`, label check included: (loss, d logits (rows, V) for mean / sum, lse, q,
    the label flag, row weights (with token scaling, times p_t), z-loss term, accuracy, predicted tokens),
    placeholders for what was not asked for. The check waits for its result here, at run time, as the eager call
    does (it raises ValueError from the compiled graph); the gradient is a fresh tensor (an op may not write over
    its input logits). Options added later come last, with defaults, so earlier calls read as before."""
    return _traced_forward(logits, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss,
                           softcap, reduction, need_grad, want_z, want_accuracy, use_token_scaling, want_predicted)


@on_input_device  # the check's event and pinned copy on the logits' device
def _traced_forward(logits, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss, softcap,
                    reduction, need_grad, want_z, want_accuracy, use_token_scaling, want_predicted):
    labels = labels.contiguous()
    labels_ok = LabelCheck(labels, logits.shape[-1], ignore_index, reduction, normalizer)
    opts = row_kernel_options(ignore_index, label_smoothing, z_loss, softcap, labels_ok.flag, class_weights)
    row_w, scale = _scales(labels, class_weights, ignore_index, reduction, normalizer, labels_ok, label_smoothing)
    fw = _forward(logits, labels, opts, need_grad, False, scale, row_w, (want_z, want_accuracy, want_predicted),
                  use_token_scaling)
    labels_ok.wait()
    return (fw.out, absent(logits) if fw.grad is None else fw.grad, fw.lse, fw.q, labels_ok.flag,
            *(absent(fw.lse) if t is None else t for t in (fw.row_w, fw.z, fw.accuracy, fw.predicted)))


@_cross_entropy_op.register_fake
def _(logits, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss, softcap, reduction,
      need_grad, want_z, want_accuracy, use_token_scaling=False, want_predicted=False):
    rows, f32 = labels.numel(), dict(dtype=torch.float32, device=logits.device)
    loss_shape = labels.shape if reduction == "none" else ()
    grad = (torch.empty((rows, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
            if need_grad and reduction != "none" else absent(logits))
    row = torch.empty(rows, **f32)
    return (torch.empty(loss_shape, **f32), grad, row, torch.empty_like(row),
            torch.empty(2, dtype=torch.int64, device=logits.device),
            torch.empty_like(row) if _row_weighted(class_weights, label_smoothing, use_token_scaling) else absent(row),
            torch.empty(loss_shape, **f32) if want_z else absent(row), torch.empty((), **f32) if want_accuracy
            else absent(row),
            torch.empty(labels.shape, dtype=torch.int64, device=logits.device) if want_predicted else absent(row))


@custom_op("cross_entropy_backward")
def _cross_entropy_backward_op(grad_out: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                               lse: torch.Tensor, q: torch.Tensor, label_flag: torch.Tensor,
                               row_w: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                               z_loss: float, softcap: Optional[float],
                               class_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reduction="none"'s gradient pass, into a fresh tensor of the logits' shape."""
    x, _ = _logit_rows(logits)
    grad = torch.empty_like(x)
    opts = row_kernel_options(ignore_index, label_smoothing, z_loss, softcap, label_flag, class_weights)
    _deferred_grad(grad_out, x, labels.contiguous().reshape(-1), lse, q, row_w, opts, grad)
    return grad.view(logits.shape)


@_cross_entropy_backward_op.register_fake
def _(grad_out, logits, labels, lse, q, label_flag, row_w, ignore_index, label_smoothing, z_loss, softcap,
      class_weights=None):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _cross_entropy_setup(ctx, inputs, output) -> None:
    logits, labels, _, class_weights, *options, reduction = inputs[:9]
    token_scaling = inputs[12]  # defaults filled in when a call leaves them out
    _, grad, lse, q, flag, row_w, z, accuracy, predicted = output
    ctx.mark_non_differentiable(grad, lse, q, flag, row_w, z, accuracy, predicted)
    ctx.options, ctx.reduction, ctx.shape = options, reduction, logits.shape
    ctx.weighted = _row_weighted(class_weights, options[1], token_scaling)
    ctx.inputs = len(inputs)
    if reduction == "none":
        ctx.save_for_backward(logits, labels, lse, q, flag, row_w, class_weights)
    else:
        ctx.save_for_backward(grad)


def _cross_entropy_grads(ctx, grad_out, *_):
    refuse_double_backward("cross_entropy")
    if ctx.reduction != "none":  # the forward computed the gradient; grad_output scales it
        (grad,) = ctx.saved_tensors
        return scaled(grad, grad_out).view(ctx.shape), *[None] * (ctx.inputs - 1)
    logits, labels, lse, q, flag, row_w, class_weights = ctx.saved_tensors
    grad = _cross_entropy_backward_op(grad_out, logits, labels, lse, q, flag, row_w if ctx.weighted else None,
                                      *ctx.options, class_weights)
    return grad, *[None] * (ctx.inputs - 1)


_cross_entropy_op.register_autograd(_cross_entropy_grads, setup_context=_cross_entropy_setup)


def _row_weighted(class_weights, label_smoothing: float, token_scaling: bool) -> bool:
    """Whether the custom op's row-weights output is a tensor: the class weights as a per-row factor (not where the
    kernel weighs its rows itself, with label smoothing) or the token scaling's p_t."""
    return (class_weights is not None and not label_smoothing) or token_scaling


def _traced_cross_entropy(logits, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss, softcap,
                          reduction, want_z, want_accuracy, use_token_scaling, want_predicted):
    """`cross_entropy`'s triton path while torch.compile traces: the custom op, outputs as the eager call's."""
    if normalizer is not None:  # a tensor argument: a number would be baked into the graph
        normalizer = torch.as_tensor(normalizer)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    out, _, _, _, _, _, z, accuracy, predicted = _cross_entropy_op(
        logits, labels, normalizer, class_weights, ignore_index, float(label_smoothing), float(z_loss),
        None if softcap is None else float(softcap), reduction, need_grad, want_z, want_accuracy, use_token_scaling,
        want_predicted)
    if not (want_z or want_accuracy or want_predicted):
        return out
    return LossOutput(out, z if want_z else None, accuracy if want_accuracy else None, None,
                      predicted if want_predicted else None)


@on_input_device  # launches, the check's event and its pinned copy all on the logits' device
def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    normalizer: float | torch.Tensor | None = None,
    inplace_grad: bool | None = None,
    class_weights: torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    use_token_scaling: bool = False,
    return_predicted_tokens: bool = False,
) -> torch.Tensor | LossOutput:
    """Cross-entropy of logits (N, V) (or (..., V)) against int64 labels (N,) (or (...)), options as above.

    Returns a 0-dim fp32 loss, or fp32 per-token losses of labels' shape for reduction="none"; a LossOutput with
    return_z_loss / return_token_accuracy / return_predicted_tokens.
    A label outside [0, V) that is not ignore_index raises ValueError (the call waits for the check's result with
    the loss kernels already queued, see _labels.LabelCheck; they touch nothing when a label is bad).
    inplace_grad: write the gradient over the logits (no second N×V buffer). None (default) does so only when
    the logits are an autograd intermediate that is not a view (typically `lm_head(h)` consumed by this loss);
    never for a leaf (the caller's own tensor) or a view (its base is usually kept, e.g. HF's returned logits).
    After an in-place call the logits hold the gradient: do not read them afterwards. Their version counter is
    bumped, so an autograd node that saved them (e.g. a torch.tanh before this loss) raises instead of silently
    using the gradient.
    While torch.compile traces, the triton path is one custom op (_custom_ops.py) that checks the labels and waits
    for the check at run time, as here; its gradient never goes over the logits (inplace_grad has no effect).
    """
    check_options(reduction, label_smoothing, softcap, z_loss, normalizer)
    if logits.dim() == 0 or logits.shape[-1] == 0:  # else an IndexError or a reshape error far from the cause
        raise ValueError(f"logits must be (..., V) with a vocabulary of V >= 1, got shape {tuple(logits.shape)}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    check_class_weights(class_weights, logits.shape[-1], logits.device)
    triton_path = use_triton(logits, labels)
    labels = labels.contiguous()  # the kernel indexes labels by row: a strided view (a column, an expand) is copied
    if triton_path and torch.compiler.is_compiling():
        return _traced_cross_entropy(logits, labels, normalizer, class_weights, ignore_index, label_smoothing, z_loss,
                                     softcap, reduction, return_z_loss, return_token_accuracy, use_token_scaling,
                                     return_predicted_tokens)
    labels_ok = LabelCheck(labels, logits.shape[-1], ignore_index, reduction, normalizer)
    extras = (return_z_loss, return_token_accuracy, return_predicted_tokens)
    if not triton_path:
        labels_ok.wait()
        loss = cross_entropy_reference(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, reduction=reduction, normalizer=normalizer, class_weights=class_weights,
            use_token_scaling=use_token_scaling,
        )
        if not any(extras):
            return loss
        z, accuracy, predicted = loss_extras_reference(
            logits, labels, ignore_index=ignore_index, z_loss=z_loss, softcap=softcap, reduction=reduction,
            normalizer=normalizer, class_weights=class_weights, use_token_scaling=use_token_scaling,
            want_z=return_z_loss, want_accuracy=return_token_accuracy, want_predicted=return_predicted_tokens)
        return LossOutput(loss, z, accuracy, None, predicted)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace_grad is None:
        inplace_grad = logits.grad_fn is not None and logits._base is None
    opts = row_kernel_options(ignore_index, label_smoothing, z_loss, softcap, labels_ok.flag, class_weights)
    row_w, scale = _scales(labels, class_weights, ignore_index, reduction, normalizer, labels_ok, label_smoothing)
    out = _CrossEntropy.apply(logits, labels, opts, need_grad, inplace_grad and need_grad, scale, row_w, extras,
                              use_token_scaling)
    labels_ok.wait()
    if not any(extras):
        return out
    loss, z, accuracy, predicted = out
    return LossOutput(loss, z if return_z_loss else None, accuracy if return_token_accuracy else None, None,
                      predicted if return_predicted_tokens else None)


class CrossEntropyLoss(nn.Module):
    """Module form of `cross_entropy`; the normaliser (a per-batch count) is passed to forward."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: float | None = None, reduction: str = "mean", use_token_scaling: bool = False):
        super().__init__()
        check_options(reduction, label_smoothing, softcap, z_loss)
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.softcap, self.reduction, self.use_token_scaling = softcap, reduction, use_token_scaling

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, normalizer=None) -> torch.Tensor:
        return cross_entropy(logits, labels, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss, softcap=self.softcap, reduction=self.reduction,
                             normalizer=normalizer, use_token_scaling=self.use_token_scaling)
