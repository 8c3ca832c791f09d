"""Kernel tuning: each op module's launch and schedule choices as one frozen dataclass, the module's ``TUNING``.

The defaults are what the H200 benchmarks chose; each field's comment gives the measurement behind it
(docs/kernels.md lists them per op). The launchers read ``TUNING.<field>`` at every call and never keep a copy, so
there is one way to change a setting, for a block of code, used by the tests that force a path and by the
benchmark sweeps and GPU test runs (``LIGER_TUNE=module.field=value``, ``set_tuning_from``)::

    from liger_models.kernels.ops import fused_linear_cross_entropy as flce
    with tuned(flce, logits_budget_bytes=4096):   # chunks of a few rows
        ...

These settings are not part of the stable API (docs/api.md): names and defaults follow the kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator


def _replaced(module: types.ModuleType, changes: dict):
    current = getattr(module, "TUNING", None)
    if current is None or not dataclasses.is_dataclass(current):
        raise TypeError(f"{module.__name__} has no TUNING settings")
    known = {f.name for f in dataclasses.fields(current)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"{module.__name__}.TUNING has no setting {', '.join(unknown)} (its settings: "
                        f"{', '.join(sorted(known))})")
    return dataclasses.replace(current, **changes)


@contextlib.contextmanager
def tuned(module: types.ModuleType, **changes) -> Iterator:
    """``module.TUNING`` with ``changes`` inside the block, restored after it (also on an exception)."""
    previous, module.TUNING = module.TUNING, _replaced(module, changes)
    try:
        yield module.TUNING
    finally:
        module.TUNING = previous


def set_tuning(module: types.ModuleType, **changes) -> None:
    """``module.TUNING`` with ``changes`` from now on (a benchmark process's settings)."""
    module.TUNING = _replaced(module, changes)


def set_tuning_from(spec: str) -> dict:
    """Settings from "module.field=value,..." (a module of liger_models.kernels.ops, or _launch; a field of its
    TUNING; a Python literal) from now on, e.g. "fused_linear_cross_entropy.overlap_ce=True,_ce_core.block_v=8192":
    the LIGER_TUNE variable of the benchmarks and of the test suite. Returns what it set."""
    import ast
    import importlib

    applied = {}
    for item in filter(None, spec.split(",")):
        target, _, literal = item.partition("=")
        module, _, name = target.strip().rpartition(".")
        package = "liger_models.kernels" if module == "_launch" else "liger_models.kernels.ops"  # _launch: shared
        mod = importlib.import_module(f"{package}.{module}")
        set_tuning(mod, **{name: ast.literal_eval(literal.strip())})
        applied[target.strip()] = getattr(mod.TUNING, name)
    return applied
