"""liger_kernel.ops.cross_entropy: LigerCrossEntropyFunction on liger_models' cross_entropy; Liger's raw Triton
kernel is refused where it is launched (liger_models' row kernel has another launch signature)."""

from .._ours import cross_entropy_call, refuse


class LigerCrossEntropyFunction:
    """``apply(input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
    return_z_loss, return_token_accuracy, return_predicted_tokens)`` → (loss, z_loss, token_accuracy,
    predicted_tokens), as Liger's Function."""

    apply = staticmethod(cross_entropy_call)


class _RawKernel:
    def __getitem__(self, grid):
        raise refuse(("liger_cross_entropy_kernel[grid](...)", "Liger's raw Triton kernel and its launch "
                      "arguments; liger_models' row kernel is _ce_core.ce_rows, with its own signature"))


liger_cross_entropy_kernel = _RawKernel()
