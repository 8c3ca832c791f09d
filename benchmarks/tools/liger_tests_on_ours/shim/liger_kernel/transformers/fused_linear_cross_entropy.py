"""liger_kernel.transformers.fused_linear_cross_entropy: LigerFusedLinearCrossEntropyLoss, Liger's constructor and
forward(lin_weight, input, target, bias) over liger_models' fused_linear_cross_entropy."""

from typing import Optional

import torch

from .functional import liger_fused_linear_cross_entropy


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    def __init__(self, ce_weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: Optional[float] = None, return_z_loss: bool = False,
                 accum_dtype: Optional[torch.dtype] = None, use_token_scaling: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
        super().__init__()
        self.ce_weight = ce_weight
        self.options = dict(ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                            label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                            return_z_loss=return_z_loss, accum_dtype=accum_dtype, use_token_scaling=use_token_scaling,
                            return_token_accuracy=return_token_accuracy,
                            return_predicted_tokens=return_predicted_tokens)

    def forward(self, lin_weight, _input, target, bias=None):
        return liger_fused_linear_cross_entropy(_input, lin_weight, target, bias, self.ce_weight, **self.options)
