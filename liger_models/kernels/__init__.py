"""Triton kernels with forward and backward passes, each beside its PyTorch reference.

The functional ops and their ``nn.Module`` wrappers are exported here (the stable names of docs/api.md); each op's
module, with its reference and its ``TUNING``, is ``liger_models.kernels.ops.<op>``. CUDA tensors run Triton; CPU
tensors run the reference, or the real kernel under ``TRITON_INTERPRET=1``. The modules beside ``ops/`` are the
machinery every op shares: where a call runs (``_dispatch``), how a kernel is launched (``_launch``), the
torch.compile custom ops (``_custom_ops``) and the tuning settings (``_tuning``).
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

from .ops.adamw import adamw_step_
from .ops.cross_entropy import CrossEntropyLoss, cross_entropy
from .ops.decode_attention import decode_attention
from .ops.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss, LossOutput, fused_linear_cross_entropy
from .ops.gated_mlp import gated_mlp, gated_mlp_packed
from .ops.geglu import geglu, geglu_packed
from .ops.layer_norm import LayerNorm, layer_norm
from .ops.qk_norm_rope import qk_norm_rope
from .ops.rms_norm import RMSNorm, add_rms_norm, rms_norm
from .ops.rope import rope, rope_packed
from .ops.swiglu import swiglu, swiglu_packed

__all__ = ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss", "LayerNorm", "LossOutput", "RMSNorm", "adamw_step_",
           "add_rms_norm", "cross_entropy", "decode_attention", "fused_linear_cross_entropy", "gated_mlp",
           "gated_mlp_packed", "geglu", "geglu_packed", "layer_norm", "qk_norm_rope", "rms_norm", "rope", "rope_packed",
           "swiglu", "swiglu_packed"]

# The op modules were liger_models.kernels.<op> in 0.1.0; most of those names are now the functional ops
# themselves. An import by the old module path still works for one minor version, through a stand-in module that
# warns once per name and hands out the moved module's attributes.
_MOVED_MODULES = ("adamw", "cross_entropy", "decode_attention", "fused_linear_cross_entropy", "gated_mlp", "geglu",
                  "layer_norm", "nf4", "qk_norm_rope", "rms_norm", "rope", "swiglu")
_MOVED_IN, _REMOVED_IN = "0.2.0", "0.3.0"


def _moved_module(name: str) -> types.ModuleType:
    old, new = f"{__name__}.{name}", f"{__name__}.ops.{name}"
    stand_in = types.ModuleType(old, f"Moved to {new}.")

    def __getattr__(attr: str):
        if attr.startswith("__"):  # module protocol probes (inspect, pickle, doctest walk sys.modules): not a use
            raise AttributeError(attr)
        value = getattr(importlib.import_module(new), attr)
        warnings.warn(f"the module {old} moved to {new} in {_MOVED_IN}; the old path goes in {_REMOVED_IN}",
                      FutureWarning, stacklevel=2)
        return value

    stand_in.__getattr__ = __getattr__
    return stand_in


for _name in _MOVED_MODULES:
    sys.modules.setdefault(f"{__name__}.{_name}", _moved_module(_name))
del _name
