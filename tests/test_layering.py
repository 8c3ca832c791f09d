"""The package's layering is one-way: kernels ← modules ← families ← auto ← medusa, lora ← train, convert ←
recipes ← cli, with shared services (checkpoint I/O, tokenizer, text rendering, input files) at the bottom. Read
from the source (ast), so a lower floor importing a higher one, an import cycle, or an import hidden in a function
to dodge one fails here, named, before it fails someone at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "liger_models"
BOTTOM, KERNELS, MODULES, FAMILIES, AUTO, MEDUSA, TRAIN, RECIPES, CLI, ROOT = range(10)
# The floor of each top-level module or package of liger_models; a package not listed is a model family when it
# holds config.py and modeling.py, as every family does.
FLOORS = {
    "atomic": BOTTOM, "input_files": BOTTOM, "hub": BOTTOM, "wrapped_checkpoint": BOTTOM, "tokenizer": BOTTOM,
    "deprecation": BOTTOM,
    "text": BOTTOM, "data": BOTTOM,
    "kernels": KERNELS,
    "modules": MODULES,
    "auto": AUTO,
    "medusa": MEDUSA, "lora": MEDUSA,
    "train": TRAIN, "convert": TRAIN,
    "recipes": RECIPES,
    "cli": CLI,
}
# Imports of the package's own modules that run inside a function, each for a reason that is not a cycle.
LAZY_ON_PURPOSE = {
    ("liger_models.cli", "liger_models.recipes"): "loaded when a command runs, not for --help",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES_FOUND = _modules()


def floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT
    top = parts[1]
    if top in FLOORS:
        return FLOORS[top]
    if (PACKAGE / top / "config.py").is_file() and (PACKAGE / top / "modeling.py").is_file():
        return FAMILIES
    raise AssertionError(f"liger_models.{top} has no floor: add it to FLOORS in {Path(__file__).name}")


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported liger_models module, line, whether inside a function) for each import of the package's own
    modules. ``from X import y`` imports the module X.y when there is one, else X."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, in_function) for alias in child.names
                             if alias.name.split(".")[0] == "liger_models")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] == "liger_models":
                    for alias in child.names:
                        target = f"{base}.{alias.name}"
                        found.append((target if target in MODULES_FOUND else base, child.lineno, in_function))
            visit(child, inside)

    visit(tree, False)
    return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES_FOUND.items()}


@pytest.mark.parametrize("module", sorted(MODULES_FOUND))
def test_no_import_from_a_higher_floor(module):
    own = floor(module)
    upward = [f"line {line}: {target}" for target, line, _ in IMPORTS[module] if floor(target) > own]
    assert not upward, f"{module} (floor {own}) imports from a higher floor: {upward}"


def test_no_import_inside_a_function_but_those_kept_lazy_on_purpose():
    hidden = [f"{module}:{line} imports {target}" for module, imports in IMPORTS.items()
              for target, line, in_function in imports
              if in_function and not any(module == m and target.startswith(t) for m, t in LAZY_ON_PURPOSE)]
    assert not hidden, f"imports inside functions: {hidden}"


def test_no_import_cycle():
    graph = {module: {target for target, _, in_function in imports if not in_function and target != module}
             for module, imports in IMPORTS.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_unknown_packages_need_a_floor(tmp_path):
    """A new family package is placed by its files; anything else must be given a floor by hand."""
    assert floor("liger_models.llama.modeling") == FAMILIES
    with pytest.raises(AssertionError, match="no floor"):
        floor("liger_models.not_a_package_here")
