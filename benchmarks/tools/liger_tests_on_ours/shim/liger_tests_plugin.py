"""The harness's pytest plugin (../run.py loads it with ``-p liger_tests_plugin``), beside Liger's own conftest.

- Refuses to run unless ``liger_kernel`` is the shim (an installed liger-kernel, as on the GPU machine, would
  otherwise test Liger against itself).
- Deselects the cases whose logits have more than LIGER_TESTS_MAX_LOGITS elements (B·T·V of their parameters;
  0 or unset: no limit). Cases without B, T, V parameters fix small shapes in their bodies and always run.
- A test during which the shim refused a missing option (liger_kernel._ours.REFUSALS) is reported as xfailed with
  that option as the reason, whatever it did with the exception.
- Under TRITON_INTERPRET=1, fp32 → bf16 casts in kernels round to nearest-even as on the GPU (the project's own
  fixture, tests/conftest.py).
- Ends with the counts: passed, failed, xfailed by refused option, skipped by reason, deselected.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import pytest

import liger_kernel
from liger_kernel import _ours
from tests import conftest as project_conftest

# The project's autouse fixture, registered here too (by name, as pytest finds fixtures in a plugin's namespace);
# importing the whole conftest as a plugin would also bring its per-test reseeding, which changes Liger's data.
interpreter_rounds_bf16 = project_conftest.interpreter_rounds_bf16

SHIM_DIR = Path(__file__).resolve().parent
_DESELECTED: list[str] = []


def max_logits() -> int:
    return int(os.environ.get("LIGER_TESTS_MAX_LOGITS", "0") or 0)


def pytest_configure(config):
    where = Path(liger_kernel.__file__).resolve()
    if not getattr(liger_kernel, "SHIM", False) or SHIM_DIR not in where.parents:
        raise pytest.UsageError(f"liger_kernel resolves to {where}, not the shim under {SHIM_DIR}: put the shim "
                                "first on sys.path (run.py does)")


def _logits(item) -> int | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if not all(k in params for k in "BTV"):
        return None
    return math.prod(params[k] for k in "BTV")


def pytest_collection_modifyitems(config, items):
    limit = max_logits()
    if not limit:
        return
    kept, dropped = [], []
    for item in items:
        size = _logits(item)
        (dropped if size is not None and size > limit else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        _DESELECTED.extend(item.nodeid for item in dropped)


def pytest_report_header(config):
    limit = max_logits()
    return [f"liger_kernel: the shim at {SHIM_DIR / 'liger_kernel'}",
            f"cases with B*T*V above {limit} logits deselected" if limit else "no size limit"]


def pytest_runtest_setup(item):
    _ours.REFUSALS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and _ours.REFUSALS:
        report.outcome = "skipped"
        report.wasxfail = f"not implemented: {_ours.REFUSALS[0]}"  # the first refused call of the test


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return report.wasxfail.removeprefix("not implemented: ")
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    return ""


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.write_sep("=", "Liger's loss tests on liger_models")
    reports = [r for kind in ("passed", "failed", "xfailed", "skipped", "error") for r in tr.stats.get(kind, [])
               if getattr(r, "when", "call") in ("call", "setup")]
    for file in sorted({r.nodeid.split("::")[0] for r in reports} | {n.split("::")[0] for n in _DESELECTED}):
        tr.write_line(file)
        mine = [r for r in reports if r.nodeid.startswith(file + "::")]
        for kind in ("passed", "failed", "xfailed", "skipped", "error"):
            of_kind = [r for r in mine if tr.stats.get(kind) and r in tr.stats[kind]]
            if not of_kind:
                continue
            tr.write_line(f"  {kind}: {len(of_kind)}")
            if kind in ("xfailed", "skipped"):
                reasons = Counter(_reason(r) for r in of_kind)
            elif kind in ("failed", "error"):
                reasons = Counter(r.nodeid.split("[")[0].split("::")[-1] for r in of_kind)
            else:
                continue
            for reason, count in reasons.most_common():
                tr.write_line(f"    {count:4d}  {reason}")
        dropped = sum(n.startswith(file + "::") for n in _DESELECTED)
        if dropped:
            tr.write_line(f"  deselected (B*T*V > {max_logits()}): {dropped}")
