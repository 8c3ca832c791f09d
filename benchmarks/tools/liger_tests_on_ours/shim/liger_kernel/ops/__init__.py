"""liger_kernel.ops: the two loss Functions, as callables with Liger's ``apply`` signature (their autograd is
liger_models' own)."""

from .cross_entropy import LigerCrossEntropyFunction
from .fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

__all__ = ["LigerCrossEntropyFunction", "LigerFusedLinearCrossEntropyFunction"]
