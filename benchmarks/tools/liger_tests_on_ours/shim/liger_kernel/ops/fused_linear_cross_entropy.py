"""liger_kernel.ops.fused_linear_cross_entropy: LigerFusedLinearCrossEntropyFunction on liger_models'
fused_linear_cross_entropy."""

from .._ours import fused_linear_cross_entropy_call


class LigerFusedLinearCrossEntropyFunction:
    """``apply(input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy, return_predicted_tokens)`` →
    (loss, z_loss, token_accuracy, predicted_tokens), as Liger's Function."""

    apply = staticmethod(fused_linear_cross_entropy_call)
