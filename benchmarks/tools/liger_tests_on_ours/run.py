"""Run Liger-Kernel's own tests of its loss options against liger_models' kernels.

Liger's test/transformers/test_cross_entropy.py and test_fused_linear_cross_entropy.py (with test/utils.py,
test/conftest.py and test/__init__.py, which they import) are taken as they are from a Liger-Kernel git mirror at a
fixed commit and run by pytest with shim/ first on sys.path. shim/liger_kernel/ provides the names those files import
(LigerCrossEntropyFunction, liger_cross_entropy, LigerFusedLinearCrossEntropyLoss, infer_device, ...), each on
liger_models' cross_entropy / fused_linear_cross_entropy; shim/liger_kernel/_ours.py holds the argument and
return-convention mapping, and refuses with NotImplementedError each Liger option liger_models lacks.
shim/liger_tests_plugin.py reports a test that met such a refusal as xfailed with the option as the reason, and
prints the counts per file. Nothing here is part of the installed package. Results: BENCHMARKS.md, "Liger-Kernel's
loss tests on our kernels"; fp32_reference_error.py beside this file explains the failures left there.

The fetched files go to a fresh temporary directory, removed afterwards, unless --dir names one (kept; used as it
is when there is no mirror, as on the GPU machine). Not in this tree by default: the lint test runs pyflakes over
every .py file under benchmarks/, ignored ones included, and Liger's files are not ours to lint.

Where: on CUDA when a GPU is present, every case; else on the CPU under TRITON_INTERPRET=1, where the cases whose
logits have more than --max-logits elements (B·T·V of their parameters; default 2^20 on the CPU, no limit on CUDA)
are deselected. The interpreter takes 20-70 s for one cross-entropy case at Liger's 3 × 423 × 32000 (every
cross-entropy option test has that shape or 2 × 4096 × 32000) and ~25 s for a linear-CE case at 8 × 128 × 1024 ×
4096, so the default CPU selection (~1 min) is the 4 × 47 × 31 × 123 linear-CE cases with every option and the
small cross-entropy cases; `--max-logits 0` with `-k` runs chosen larger ones.

    python benchmarks/tools/liger_tests_on_ours/run.py                      # CPU: the small cases; GPU: all
    python benchmarks/tools/liger_tests_on_ours/run.py --max-logits 0 -- -k "test_cross_entropy and 423"
    python benchmarks/tools/liger_tests_on_ours/run.py --dir .liger_tests --fetch-only   # for the GPU machine, then
    bash benchmarks/device_session.sh liger-tests                           # there, with .liger_tests carried

Arguments after -- go to pytest. --mirror (default $LIGER_KERNEL_MIRROR or /work/.mirror/linkedin+Liger-Kernel/repo)
is a bare git directory; --commit (default ead96b61, the commit BENCHMARKS.md reports on) the revision read from it.
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
ROOT = HERE.parents[2]
MIRROR = os.environ.get("LIGER_KERNEL_MIRROR", "/work/.mirror/linkedin+Liger-Kernel/repo")
COMMIT = "ead96b61"
FILES = ["test/__init__.py", "test/conftest.py", "test/utils.py", "test/transformers/test_cross_entropy.py",
         "test/transformers/test_fused_linear_cross_entropy.py"]
TESTS = FILES[-2:]
CPU_MAX_LOGITS = 1 << 20


def fetch(mirror: str, commit: str, into: Path) -> str:
    """Write FILES at commit from the bare mirror under into/; returns the full commit id (also into/SOURCE)."""
    full = subprocess.run(["git", "--git-dir", mirror, "rev-parse", "--verify", f"{commit}^{{commit}}"],
                          check=True, capture_output=True, text=True).stdout.strip()
    for name in FILES:
        text = subprocess.run(["git", "--git-dir", mirror, "show", f"{full}:{name}"], check=True,
                              capture_output=True).stdout
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_bytes(text)
    (into / "SOURCE").write_text(f"linkedin/Liger-Kernel {full}\n")
    return full


def run_tests(into: Path, max_logits: int, gpu: bool, pytest_args: list[str]) -> int:
    # Liger's own pytest settings (asyncio mode, live logging, testpaths) are not needed: a plain config here keeps
    # pytest from reading this repository's pyproject.toml (its -m 'not gpu', its pythonpath).
    (into / "pytest.ini").write_text("[pytest]\npython_files = test_*.py\n")
    env = dict(os.environ, LIGER_TESTS_MAX_LOGITS=str(max_logits))
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(into), str(ROOT)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "-c", str(into / "pytest.ini"), "--rootdir", str(into),
               "-p", "no:cacheprovider", "-p", "liger_tests_plugin", "-rfE", *pytest_args,
               *(str(into / t) for t in TESTS)]
    print(" ".join(command), flush=True)
    return subprocess.run(command, cwd=into, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default=MIRROR)
    parser.add_argument("--commit", default=COMMIT)
    parser.add_argument("--dir", type=Path, help="where Liger's files go (kept); reused as it is without a mirror")
    parser.add_argument("--fetch-only", action="store_true")
    parser.add_argument("--max-logits", type=int, help=f"deselect cases above B*T*V (0: none; default "
                                                       f"{CPU_MAX_LOGITS} on the CPU, none on CUDA)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()

    into = args.dir.resolve() if args.dir else Path(tempfile.mkdtemp(prefix="liger_tests_"))
    try:
        if Path(args.mirror).is_dir():
            into.mkdir(parents=True, exist_ok=True)
            print(f"Liger-Kernel {fetch(args.mirror, args.commit, into)} -> {into}", flush=True)
        elif all((into / name).is_file() for name in FILES):
            print(f"no mirror at {args.mirror}; using {into}: {(into / 'SOURCE').read_text().strip()}", flush=True)
        else:
            print(f"no mirror at {args.mirror} and no fetched files in {into}", file=sys.stderr)
            return 2
        if args.fetch_only:
            return 0
        import torch

        gpu = torch.cuda.is_available()
        max_logits = args.max_logits if args.max_logits is not None else (0 if gpu else CPU_MAX_LOGITS)
        return run_tests(into, max_logits, gpu, args.pytest_args)
    finally:
        if args.dir is None:
            shutil.rmtree(into, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
