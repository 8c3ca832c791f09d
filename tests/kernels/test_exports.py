"""The functional ops and modules are exported from liger_models.kernels (docs/api.md); the op modules live in
liger_models.kernels.ops, and their paths of 0.1.0 (liger_models.kernels.<op>) still import for one minor version
with a FutureWarning that names the new path."""

from __future__ import annotations

import importlib
import warnings

import pytest

import liger_models.kernels as kernels

MOVED = {"adamw": "adamw_step_", "cross_entropy": "cross_entropy_reference", "decode_attention": "decode_attention",
         "fused_linear_cross_entropy": "fused_linear_cross_entropy_reference", "gated_mlp": "gated_mlp_reference",
         "geglu": "geglu_packed", "layer_norm": "layer_norm_reference", "nf4": "quantize_nf4",
         "qk_norm_rope": "qk_norm_rope_reference", "rms_norm": "rms_norm_reference", "rope": "rope_reference",
         "swiglu": "swiglu_packed"}


@pytest.mark.parametrize("name", kernels.__all__)
def test_every_export_is_the_op_modules_own_object(name):
    exported = getattr(kernels, name)
    home = importlib.import_module(exported.__module__)
    assert home.__name__.startswith("liger_models.kernels.ops.") and getattr(home, name) is exported


@pytest.mark.parametrize("module, attribute", MOVED.items())
def test_old_module_path_still_imports_with_a_warning(module, attribute):
    new = importlib.import_module(f"liger_models.kernels.ops.{module}")
    with pytest.warns(FutureWarning, match=rf"liger_models\.kernels\.{module} moved to "
                                           rf"liger_models\.kernels\.ops\.{module} in 0\.2\.0; .* goes in 0\.3\.0"):
        old = getattr(importlib.import_module(f"liger_models.kernels.{module}"), attribute)
    assert old is getattr(new, attribute)


def test_importing_the_package_warns_about_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(kernels)
        import inspect

        inspect.getmodule(test_importing_the_package_warns_about_nothing)  # walks sys.modules, stand-ins included


def test_writing_through_the_old_module_path_is_refused_naming_the_new_one(monkeypatch):
    # A write through the stand-in would land where no op reads it (`liger_models.kernels.rms_norm.use_triton =
    # ...` silently changing nothing): refused, naming the path that does act.
    new = importlib.import_module("liger_models.kernels.ops.rms_norm")
    old = importlib.import_module("liger_models.kernels.rms_norm")
    original = new.use_triton
    with pytest.raises(AttributeError, match=r"liger_models\.kernels\.rms_norm moved to "
                                             r"liger_models\.kernels\.ops\.rms_norm .*: set use_triton there"):
        monkeypatch.setattr(old, "use_triton", lambda *tensors: False)
    with pytest.raises(AttributeError, match="set use_triton there"):
        del old.use_triton
    assert new.use_triton is original
