"""Cross-entropy on materialised logits: online softmax, one pass, gradient written in place.

Math per row x (length V, fp32 whatever the input dtype), target t, ε = label_smoothing, z = z_loss:
  softcap c:  x ← c·tanh(x / c)                         (Gemma-2 final-logit soft-capping)
  lse = log Σ_j exp(x_j)
  loss = (1−ε)·(lse − x_t) + ε·(lse − mean_j x_j) + z·lse²     (PyTorch / HF label smoothing: ε spread as ε/V)
  dloss/dx_j = p_j·(1 + 2z·lse) − ε/V − (1−ε)·[j = t]        (× (1 − tanh²(x_j/c)) through the softcap)
Rows whose label is ignore_index contribute 0 to the loss and get a zero gradient. reduction="mean" divides the
sum by `normalizer` when given (the global count of non-ignored tokens, for gradient accumulation / data
parallelism) or else by the local count; a zero denominator counts as 1 (every label ignored → loss 0, no NaN).

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

import torch
from torch import nn

from ._ce_core import ce_rows
from ._loss_common import check_options, scale_, scaled_sum, take_grads
from ._labels import LabelCheck, check_labels, mean_denominator
from ._dispatch import once_differentiable, use_triton
from ._launch import on_input_device

# check_labels: the CUDA-graph trainer checks every batch with it before copying it into the graph's inputs.
__all__ = ["CrossEntropyLoss", "check_labels", "cross_entropy", "cross_entropy_reference", "reduce_loss"]


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
    if label_smoothing:
        loss = loss + label_smoothing * (lse - x.mean(-1))
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    out = reduce_loss(loss, valid, reduction, normalizer)
    return out.reshape(labels.shape) if reduction == "none" else out


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
    def forward(ctx, logits, labels, opts: dict, need_grad: bool, inplace: bool, scale: torch.Tensor | None):
        # scale: d loss / d per-token loss for mean / sum (LabelCheck's 0-dim device tensor); None for "none".
        x = logits.reshape(-1, logits.shape[-1])
        if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
            x, inplace = x.contiguous(), need_grad  # a private copy: the gradient may always go into it
        flat = labels.reshape(-1)
        loss = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        lse, q = torch.empty_like(loss), torch.empty_like(loss)
        fused = need_grad and scale is not None
        grad = (x if inplace else torch.empty_like(x)) if fused else None
        ce_rows(x, flat, grad=grad, loss=loss, lse=lse, q=q, rank=None, scale=scale if fused else None, **opts)
        if fused and inplace and x.data_ptr() == logits.data_ptr():
            torch.autograd.graph.increment_version(logits)  # a node that saved the logits now fails loudly
        ctx.opts, ctx.inplace, ctx.shape, ctx.fused = opts, inplace, logits.shape, fused
        ctx.grads = (grad,)  # a plain attribute, not saved: it may be the logits' own (version-bumped) buffer
        if need_grad and not fused:
            ctx.save_for_backward(x, flat, lse, q)
        return loss.reshape(labels.shape) if scale is None else scaled_sum(loss, scale)  # ignored rows' losses are 0

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.fused:
            (grad,) = take_grads(ctx)
            scale_(grad, grad_out)
        else:  # reduction="none": one read + one write with the per-row grad_output
            x, flat, lse, q = ctx.saved_tensors
            grad = x if ctx.inplace else torch.empty_like(x)
            scale = grad_out.reshape(-1).float().contiguous()
            ce_rows(x, flat, grad=grad, loss=None, lse=lse, q=q, rank=None, scale=scale, **ctx.opts)
            if ctx.inplace:
                torch.autograd.graph.increment_version(x)
        return grad.view(ctx.shape), None, None, None, None, None


@torch.compiler.disable  # the label check reads the host; under torch.compile the loss is one clean graph break
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
) -> torch.Tensor:
    """Cross-entropy of logits (N, V) (or (..., V)) against int64 labels (N,) (or (...)), options as above.

    Returns a 0-dim fp32 loss, or fp32 per-token losses of labels' shape for reduction="none".
    A label outside [0, V) that is not ignore_index raises ValueError (the call waits for the check's result with
    the loss kernels already queued, see _labels.LabelCheck; they touch nothing when a label is bad).
    inplace_grad: write the gradient over the logits (no second N×V buffer). None (default) does so only when
    the logits are an autograd intermediate that is not a view (typically `lm_head(h)` consumed by this loss);
    never for a leaf (the caller's own tensor) or a view (its base is usually kept, e.g. HF's returned logits).
    After an in-place call the logits hold the gradient: do not read them afterwards. Their version counter is
    bumped, so an autograd node that saved them (e.g. a torch.tanh before this loss) raises instead of silently
    using the gradient.
    """
    check_options(reduction, label_smoothing, softcap, z_loss, normalizer)
    if logits.dim() == 0 or logits.shape[-1] == 0:  # else an IndexError or a reshape error far from the cause
        raise ValueError(f"logits must be (..., V) with a vocabulary of V >= 1, got shape {tuple(logits.shape)}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    triton_path = use_triton(logits, labels)
    labels = labels.contiguous()  # the kernel indexes labels by row: a strided view (a column, an expand) is copied
    labels_ok = LabelCheck(labels, logits.shape[-1], ignore_index, reduction, normalizer)
    if not triton_path:
        labels_ok.wait()
        return cross_entropy_reference(
            logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, reduction=reduction, normalizer=normalizer,
        )
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    if inplace_grad is None:
        inplace_grad = logits.grad_fn is not None and logits._base is None
    opts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                label_flag=labels_ok.flag)
    out = _CrossEntropy.apply(logits, labels, opts, need_grad, inplace_grad and need_grad,
                              None if reduction == "none" else labels_ok.scale)
    labels_ok.wait()
    return out


class CrossEntropyLoss(nn.Module):
    """Module form of `cross_entropy`; the normaliser (a per-batch count) is passed to forward."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: float | None = None, reduction: str = "mean"):
        super().__init__()
        check_options(reduction, label_smoothing, softcap, z_loss)
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.softcap, self.reduction = softcap, reduction

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, normalizer=None) -> torch.Tensor:
        return cross_entropy(logits, labels, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                             z_loss=self.z_loss, softcap=self.softcap, reduction=self.reduction,
                             normalizer=normalizer)
