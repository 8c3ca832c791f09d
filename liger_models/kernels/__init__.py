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
from .ops.softcap_attention import softcap_attention
from .ops.swiglu import swiglu, swiglu_packed

__all__ = ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss", "LayerNorm", "LossOutput", "RMSNorm", "adamw_step_",
           "add_rms_norm", "cross_entropy", "decode_attention", "fused_linear_cross_entropy", "gated_mlp",
           "gated_mlp_packed", "geglu", "geglu_packed", "layer_norm", "qk_norm_rope", "rms_norm", "rope", "rope_packed",
           "softcap_attention", "swiglu", "swiglu_packed"]

# The op modules were liger_models.kernels.<op> in 0.1.0; most of those names are now the functional ops
# themselves. An import by the old module path still works for one minor version, through a stand-in module that
# warns once per name and hands out the moved module's attributes.
_MOVED_MODULES = ("adamw", "cross_entropy", "decode_attention", "fused_linear_cross_entropy", "gated_mlp", "geglu",
                  "layer_norm", "nf4", "qk_norm_rope", "rms_norm", "rope", "swiglu")
_MOVED_IN, _REMOVED_IN = "0.2.0", "0.3.0"


class _MovedModule(types.ModuleType):
    """A 0.1.0 module path. Reads reach the moved module with a FutureWarning; a write (``module.flag = ...``, a
    monkeypatch) is refused, naming the new path: it would land on this stand-in, which no op reads."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"Moved to {new}.")
        object.__setattr__(self, "_new", new)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # module protocol probes (inspect, pickle, doctest walk sys.modules): not a use
            raise AttributeError(attr)
        warnings.warn(f"the module {self.__name__} moved to {self._new} in {_MOVED_IN}; the old path goes in "
                      f"{_REMOVED_IN}", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(self._new), attr)

    def __setattr__(self, attr: str, value) -> None:
        if attr.startswith("__"):
            object.__setattr__(self, attr, value)
        else:
            self._refuse_write(attr)

    def __delattr__(self, attr: str) -> None:
        self._refuse_write(attr)

    def _refuse_write(self, attr: str):
        raise AttributeError(f"the module {self.__name__} moved to {self._new} in {_MOVED_IN}: set {attr} there "
                             f"(through the old path it would change nothing the ops read)")


for _name in _MOVED_MODULES:
    sys.modules.setdefault(f"{__name__}.{_name}", _MovedModule(f"{__name__}.{_name}", f"{__name__}.ops.{_name}"))
del _name
