"""Kernel tuning: each op module's launch and schedule choices as one frozen dataclass, the module's ``TUNING``.

The defaults are what the H200 benchmarks chose; each field's comment gives the measurement behind it
(docs/kernels.md lists them per op). The launchers read ``TUNING.<field>`` at every call and never keep a copy, so
there is one way to change a setting, for a block of code, used by the tests that force a path and by the
benchmark sweeps (benchmarks/harness.py's ``LIGER_TUNE=module.field=value``)::

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
