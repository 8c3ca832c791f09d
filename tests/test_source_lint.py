"""Every Python file of the project (package, tests, benchmarks) passes pyflakes: an undefined name in a benchmark's
rarely taken branch, or an import left behind by a move, fails here rather than in the run that needs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _Collect(Reporter):
    def __init__(self):
        self.problems: list[str] = []

    def unexpectedError(self, filename, message):
        self.problems.append(f"{filename}: {message}")

    def syntaxError(self, filename, message, lineno, offset, text):
        self.problems.append(f"{filename}:{lineno}: {message}")

    def flake(self, message):
        self.problems.append(str(message))


@pytest.mark.parametrize("tree", ["liger_models", "tests", "benchmarks"])
def test_pyflakes_finds_nothing(tree):
    report = _Collect()
    for path in sorted((ROOT / tree).rglob("*.py")):
        pyflakes_api.checkPath(str(path), report)
    assert not report.problems, "\n".join(report.problems)


def test_no_test_monkeypatches_a_torch_config_module():
    """torch's config modules (torch._dynamo.config, torch._inductor.config, ...) answer attribute reads through
    __getattr__, so monkeypatch's undo deletes the entry instead of restoring it, and every later compile in that
    process fails ("... does not exist"). Tests patch them with the module's own ``config.patch(...)``."""
    pattern = re.compile(r"monkeypatch\.setattr\(\s*torch\.[\w.]*config\b")
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "tests").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
