"""The shim's one mapping: Liger-Kernel's loss calls (argument names, defaults, return and error conventions) onto
liger_models' `cross_entropy` and `fused_linear_cross_entropy`.

What liger_models does not implement is refused with a NotImplementedError naming the option, and every refusal is
recorded in REFUSALS, so the harness's plugin reports a test that met one as xfailed with that reason, never as
passed (a test that catches RuntimeError, NotImplementedError's base, cannot turn a refusal into a pass).

Conventions mapped, each Liger's as its ops define it:
- return_predicted_tokens and use_token_scaling are ours under the same names, with Liger's semantics; the
  predictions come back in LossOutput.predicted_tokens, Liger's fourth output.
- Liger's cross-entropy returns the loss and the z-loss term in the logits' dtype; ours in fp32: cast
  (differentiably) to the logits' dtype. Its linear-CE returns an fp32 loss and a z-loss term in the hidden dtype.
- Liger's linear-CE accumulates dW in the weight's own dtype when accum_dtype is None (the weight as passed, so
  fp32 under autocast); ours takes accum_dtype=weight.dtype for that.
- Under torch.autocast Liger's linear-CE runs its GEMMs in autocast's dtype; ours takes one dtype for all operands,
  and our models cast them first (liger_models.modules.autocast_operands): the shim does the same.
- A label outside [0, V) that is not ignore_index: Liger asserts ("out of bounds"), ours raises ValueError naming
  the label; the shim re-raises ours as an AssertionError carrying our message.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from liger_models.kernels import cross_entropy, fused_linear_cross_entropy
from liger_models.modules import autocast_operands

# The options each refused call named, since the plugin last cleared this (before each test).
REFUSALS: list[str] = []


def refuse(*missing: tuple[str, str]) -> NotImplementedError:
    """The error for one call that asks for these (option, why it is missing) pairs; recorded in REFUSALS by option
    names."""
    REFUSALS.append(" + ".join(option for option, _ in missing))
    return NotImplementedError("liger_models does not implement " + "; ".join(f"{o} ({why})" for o, why in missing))


@dataclass
class CrossEntropyOutput:
    """Liger's structured result (liger_kernel.transformers.functional.CrossEntropyOutput): the same four fields."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def _refuse_missing(weight, lse_square_scale: float, label_smoothing: float, reduction: str,
                    return_token_accuracy: bool) -> None:
    """Every option of the call that liger_models lacks, named together in one NotImplementedError."""
    missing = []
    if return_token_accuracy and reduction == "none":
        missing.append(("return_token_accuracy with reduction='none'", "the accuracy is one share over the batch, "
                                                                       "not a value per token"))
    if weight is not None and lse_square_scale:
        missing.append(("class weights with lse_square_scale",
                        "Liger adds the z-loss unweighted and divides it by the token count, where the loss is "
                        "divided by the targets' weight sum; ours weighs each token's z-loss by its target's weight, "
                        "as the rest of its loss"))
    if missing:
        raise refuse(*missing)


@contextlib.contextmanager
def _labels_as_liger_asserts():
    try:
        yield
    except ValueError as error:
        if "outside the vocabulary" not in str(error):
            raise
        raise AssertionError(f"Target out of bounds (liger_models: {error})") from error


def _extras(out, return_z_loss: bool, return_token_accuracy: bool, return_predicted_tokens: bool):
    """(loss, z_loss, token_accuracy, predicted_tokens) of our result: a LossOutput when any extra was asked for, else
    the loss alone."""
    if return_z_loss or return_token_accuracy or return_predicted_tokens:
        return out.loss, out.z_loss, out.token_accuracy, out.predicted_tokens
    return out, None, None, None


def cross_entropy_call(input, target, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                       reduction="mean", softcap=None, return_z_loss=False, return_token_accuracy=False,
                       return_predicted_tokens=False):
    """LigerCrossEntropyFunction.apply's arguments, in its order; its 4-tuple back."""
    _refuse_missing(weight, lse_square_scale, label_smoothing, reduction, return_token_accuracy)
    with _labels_as_liger_asserts():
        out = cross_entropy(input, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                            z_loss=lse_square_scale, softcap=softcap, reduction=reduction, class_weights=weight,
                            return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                            return_predicted_tokens=return_predicted_tokens)
    loss, z, accuracy, predicted = _extras(out, return_z_loss, return_token_accuracy, return_predicted_tokens)
    return loss.to(input.dtype), None if z is None else z.to(input.dtype), accuracy, predicted


def fused_linear_cross_entropy_call(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                    lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                    return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                    return_token_accuracy=False, return_predicted_tokens=False):
    """LigerFusedLinearCrossEntropyFunction.apply's arguments, in its order; its 4-tuple back."""
    _refuse_missing(ce_weight, lse_square_scale, label_smoothing, reduction, return_token_accuracy)
    out_dtype = input.dtype
    accum_dtype = weight.dtype if accum_dtype is None else accum_dtype
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        input, weight = autocast_operands(input, weight)
        bias = None if bias is None else bias.to(weight.dtype)
    with torch.autocast(device_type, enabled=False), _labels_as_liger_asserts():
        out = fused_linear_cross_entropy(input, weight, target, bias, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=lse_square_scale, softcap=softcap,
                                         reduction=reduction, accum_dtype=accum_dtype, class_weights=ce_weight,
                                         return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                                         use_token_scaling=use_token_scaling,
                                         return_predicted_tokens=return_predicted_tokens)
    loss, z, accuracy, predicted = _extras(out, return_z_loss, return_token_accuracy, return_predicted_tokens)
    return loss, None if z is None else z.to(out_dtype), accuracy, predicted


def structured(result: tuple, return_z_loss: bool, return_token_accuracy: bool, return_predicted_tokens: bool):
    """What Liger's functional API and modules return: the loss alone, or a CrossEntropyOutput with any extra."""
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return result[0]
    return CrossEntropyOutput(*result)
