"""Kernel settings (liger_models/kernels/_tuning.py): one frozen TUNING per op module, read at every call, changed
only through ``tuned`` / ``set_tuning``; every ``TUNING.<name>`` a module reads is one of its fields (GPU-only paths
included, which the CPU suite never runs)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import liger_models.kernels as kernels
import liger_models.kernels.ops as ops
from liger_models.kernels.ops import fused_linear_cross_entropy as flce
from liger_models.kernels._tuning import set_tuning, tuned

MODULES = [importlib.import_module(f"{package.__name__}.{m.name}") for package in (kernels, ops)
           for m in pkgutil.iter_modules(package.__path__) if m.name != "ops"]
TUNED = [m for m in MODULES if hasattr(m, "TUNING")]


def test_every_op_module_with_settings_has_one_frozen_tuning():
    assert {m.__name__.rsplit(".", 1)[1] for m in TUNED} >= {
        "fused_linear_cross_entropy", "_ce_core", "_grad_filter", "_labels", "_loss_common", "_launch",
        "decode_attention", "adamw", "gated_mlp", "rope", "rms_norm"}
    for module in TUNED:
        assert dataclasses.is_dataclass(module.TUNING) and module.TUNING.__dataclass_params__.frozen, module.__name__
        with pytest.raises(dataclasses.FrozenInstanceError):
            module.TUNING.__setattr__(dataclasses.fields(module.TUNING)[0].name, None)


@pytest.mark.parametrize("module", TUNED, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_every_setting_read_is_a_field(module):
    source = Path(module.__file__).read_text()
    read = set(re.findall(r"(?<![\w.])TUNING\.(\w+)", source))
    fields = {f.name for f in dataclasses.fields(module.TUNING)}
    assert read and read <= fields, sorted(read - fields)
    # and nothing assigns module-level upper-case tunables any more: settings live in TUNING only
    assigned = {t.id for node in ast.parse(source).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name) and t.id.isupper() and t.id != "TUNING"}
    assert not (assigned & {n.upper() for n in fields}), sorted(assigned)


def test_settings_read_from_other_modules_are_fields():
    """``<module>.TUNING.<name>`` anywhere in the package (an import alias of a kernel module) names a field."""
    by_name = {m.__name__.rsplit(".", 1)[1]: m for m in TUNED}
    found = 0
    for path in Path(kernels.__file__).parents[1].rglob("*.py"):
        source = path.read_text()
        aliases = {alias or name: name for name, alias in
                   re.findall(r"from (?:\.+|liger_models\.kernels(?:\.ops)?) import (\w+)(?: as (\w+))?", source)}
        for alias, name in re.findall(r"\b(\w+)\.TUNING\.(\w+)", source):
            module = by_name.get(aliases.get(alias, alias))
            assert module is not None, f"{path}: {alias}.TUNING"
            assert name in {f.name for f in dataclasses.fields(module.TUNING)}, f"{path}: {alias}.TUNING.{name}"
            found += 1
    assert found


def test_tuned_overrides_for_the_block_and_restores_even_on_error():
    before = flce.TUNING
    with pytest.raises(KeyError), tuned(flce, overlap_ce=not before.overlap_ce, logits_budget_bytes=4096) as inside:
        assert flce.TUNING is inside and inside.overlap_ce is not before.overlap_ce
        assert inside.logits_budget_bytes == 4096 and inside.max_scratch_bytes == before.max_scratch_bytes
        raise KeyError("inside")
    assert flce.TUNING is before


def test_an_unknown_setting_is_refused_by_name():
    with pytest.raises(TypeError, match=r"fused_linear_cross_entropy.TUNING has no setting overlap "):
        with tuned(flce, overlap=True):
            pass
    before = flce.TUNING
    with pytest.raises(TypeError, match="has no setting"):
        set_tuning(flce, logits_budget=1)
    assert flce.TUNING is before


def test_the_tune_fixture_restores_after_the_test(tune):
    before = flce.TUNING
    tune(flce, grad_filter_eps=1e-3)
    tune(flce, max_scratch_bytes=1 << 20)
    assert (flce.TUNING.grad_filter_eps, flce.TUNING.max_scratch_bytes) == (1e-3, 1 << 20)
    assert before.grad_filter_eps is None
