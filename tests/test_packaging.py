"""The repository root never shadows an installed package, and the package tree installs as one.

A clone is run from its root all the time (pytest's `pythonpath = ["."]`, `python -m ...`, scripts in benchmarks/),
which puts the root first on sys.path: a top-level folder named like a module that a dependency imports (a
`kernels/` beside Hugging Face's `kernels`, which transformers imports) would be picked up in its place.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _root_module_names() -> set[str]:
    """What `import NAME` could find at the repository root: folders and .py files."""
    names = set()
    for entry in ROOT.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            names.add(entry.name)
        elif entry.suffix == ".py":
            names.add(entry.stem)
    return names


def test_no_root_entry_is_named_like_an_installed_top_level_module():
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions
    own = {"liger_models", "tests"}  # tests/ is this repository's; setuptools' find never installs it
    clashes = {name: installed[name] for name in _root_module_names() - own if name in installed}
    assert not clashes, f"repository root entries shadow installed packages: {clashes}"
    assert "liger_models" in _root_module_names()


@pytest.mark.parametrize("module", ["transformers", "kernels", "safetensors", "tokenizers", "huggingface_hub"])
def test_importing_a_dependency_from_the_root_picks_up_nothing_of_this_repository(module):
    """Imported the way a script in a clone imports it: the repository root first on sys.path, cwd the root."""
    try:
        importlib.metadata.distribution(module)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{module} is not installed")
    code = (
        "import json, sys, importlib\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"m = importlib.import_module({module!r})\n"
        "if hasattr(m, '__getattr__') and hasattr(m, 'LlamaConfig'):\n"
        "    m.LlamaConfig  # transformers imports lazily: touch a config to pull in its integrations\n"
        "files = [getattr(v, '__file__', None) or '' for v in list(sys.modules.values())]\n"
        "print(json.dumps(files))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    files = json.loads(out.stdout.strip().splitlines()[-1])
    # Some built-in modules carry a bare name (torch._classes: "_classes.py"): only real paths count.
    from_repo = sorted(f for f in files if Path(f).is_absolute() and Path(f).resolve().is_relative_to(ROOT))
    assert not from_repo, f"importing {module} from the root loaded this repository's files: {from_repo[:5]}"


def test_setuptools_finds_every_package_and_nothing_else():
    """The package list is found, not kept by hand: every folder under liger_models/ with Python files is a
    package (has __init__.py), and pyproject maps no folder from elsewhere into it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools_cfg = pyproject["tool"]["setuptools"]
    assert "package-dir" not in setuptools_cfg and "packages" not in {k for k in setuptools_cfg if k != "packages"}
    assert setuptools_cfg["packages"]["find"]["include"] == ["liger_models*"]
    for folder in (ROOT / "liger_models").rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), f"{folder.relative_to(ROOT)} has modules but no __init__.py"


def test_runtime_imports_are_runtime_dependencies():
    """Every third-party module the package imports is a runtime dependency, not only a test or bench extra (the
    demo must run after `pip install -e .` alone), or an optional one (an extra of its own) imported only where it is
    used."""
    import ast

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {_requirement_name(r) for r in pyproject["project"]["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    stdlib = sys.stdlib_module_names
    never = {"transformers"}  # the models run without it: it is only the tests' reference
    extras = {_requirement_name(r) for extra, reqs in pyproject["project"]["optional-dependencies"].items()
              if extra not in ("test", "bench") for r in reqs}  # the users' optional features
    missing, eager = {}, {}
    for path in (ROOT / "liger_models").rglob("*.py"):
        tree = ast.parse(path.read_text())
        in_functions = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for node in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in never, f"{path.relative_to(ROOT)} imports {top}"
                if top in stdlib or top == "liger_models":
                    continue
                dists = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
                if dists & declared:
                    continue
                # An optional dependency (bitsandbytes for --optimizer's 8-bit choices): in an extra, and imported
                # only inside the function that needs it, so that nothing else ever asks for it.
                if not dists & extras:
                    missing.setdefault(top, set()).add(str(path.relative_to(ROOT)))
                elif id(node) not in in_functions:
                    eager.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    assert not missing, f"imported at run time but not in [project.dependencies]: {missing}"
    assert not eager, f"optional dependencies imported at module level: {eager}"


def _requirement_name(requirement: str) -> str:
    name = requirement
    for sep in "<>=!~;[ ":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def test_the_version_is_written_once():
    import liger_models

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "liger_models.__version__"}
    assert importlib.metadata.version("liger-models") == liger_models.__version__


def test_importing_the_package_and_its_cli_leaves_torch_dynamo_unloaded():
    """torch._dynamo takes about 1 s to import, which the CLI's start and every rank of a launch would pay for
    nothing when they never compile (liger_models.kernels._dispatch.opaque_to_compile). Checked in a fresh process,
    against what importing torch alone loads."""
    code = ("import sys, torch; before = 'torch._dynamo' in sys.modules; import liger_models.cli; "
            "print(before, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    torch_loads_it, loaded = out.stdout.split()
    if torch_loads_it == "True":
        pytest.skip("this torch imports torch._dynamo itself")
    assert loaded == "False"
