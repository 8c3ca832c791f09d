"""liger_kernel.transformers.cross_entropy: LigerCrossEntropyLoss, Liger's constructor over liger_models'
cross_entropy."""

from typing import Optional

import torch

from .functional import liger_cross_entropy


class LigerCrossEntropyLoss(torch.nn.Module):
    def __init__(self, weight: Optional[torch.Tensor] = None, ignore_index: int = -100,
                 lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: Optional[float] = None, return_z_loss: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False):
        super().__init__()
        self.weight = weight
        self.options = dict(ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                            label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
                            return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                            return_predicted_tokens=return_predicted_tokens)

    def forward(self, _input: torch.Tensor, target: torch.Tensor):
        return liger_cross_entropy(_input, target, self.weight, **self.options)
