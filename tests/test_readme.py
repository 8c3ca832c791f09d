"""The README's quickstart runs as written, on the model `liger-models init-model` makes (no download)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _block_after(marker: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(f"<!-- {marker} -->") + 2  # the marker, then the ```python fence
    end = lines.index("```", start)
    return "\n".join(lines[start:end]) + "\n"


def test_quickstart_runs_as_written(tmp_path):
    subprocess.run([sys.executable, "-m", "liger_models.cli", "init-model", "--output-dir", "runs/base"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)
    code = _block_after("quickstart")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("loss ") and float(line.split()[1].rstrip(":")) > 0
