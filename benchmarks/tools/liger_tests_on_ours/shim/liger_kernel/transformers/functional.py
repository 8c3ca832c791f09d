"""liger_kernel.transformers.functional: the two loss functions with Liger's keywords and defaults."""

from typing import Optional

from .._ours import CrossEntropyOutput, cross_entropy_call, fused_linear_cross_entropy_call, structured

__all__ = ["CrossEntropyOutput", "liger_cross_entropy", "liger_fused_linear_cross_entropy"]


def liger_cross_entropy(input, target, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                        reduction: str = "mean", label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                        softcap: Optional[float] = None, return_z_loss: bool = False,
                        return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
    """torch's F.cross_entropy signature plus Liger's options; size_average and reduce are placeholders in Liger too
    (unused)."""
    result = cross_entropy_call(input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction,
                                softcap, return_z_loss, return_token_accuracy, return_predicted_tokens)
    return structured(result, return_z_loss, return_token_accuracy, return_predicted_tokens)


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
                                     lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                                     reduction: str = "mean", softcap: Optional[float] = None,
                                     return_z_loss: bool = False, accum_dtype=None, use_token_scaling: bool = False,
                                     return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
    result = fused_linear_cross_entropy_call(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
                                             label_smoothing, reduction, softcap, return_z_loss, accum_dtype,
                                             use_token_scaling, return_token_accuracy, return_predicted_tokens)
    return structured(result, return_z_loss, return_token_accuracy, return_predicted_tokens)
