"""Resuming after a job that died mid-write of its logs: a torn last line of metrics.jsonl is not an obstacle."""

from __future__ import annotations

import json

import pytest

from liger_models.cli import build_parser
from liger_models.recipes import train_causal_lm

pytestmark = pytest.mark.usefixtures("reference_path")


def _args(model_dir, data, out, *extra: str):
    return build_parser().parse_args([
        "train", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--seq-len", "32",
        "--batch-size", "2", "--max-steps", "3", "--save-every", "2", "--lr", "3e-3", "--warmup-steps", "1",
        "--quiet", "--dtype", "fp32", *extra])


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_resume_survives_a_torn_last_log_line(tiny_model_dir, text_file, tmp_path):
    """A job killed (or out of disk) while appending to metrics.jsonl / eval.jsonl leaves a partial last line;
    --resume auto then failed with a JSONDecodeError, so the run could not be continued at all."""
    out = tmp_path / "run"
    train_causal_lm(_args(tiny_model_dir, text_file, out, "--eval-data", str(text_file), "--eval-batches", "1",
                          "--eval-every", "1"))
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = out / name
        path.write_text(path.read_text(encoding="utf-8") + '{"step": 4, "loss": 1.2', encoding="utf-8")
    resumed = train_causal_lm(_args(tiny_model_dir, text_file, out, "--eval-data", str(text_file),
                                    "--eval-batches", "1", "--eval-every", "1", "--max-steps", "4",
                                    "--resume", "auto"))
    assert [m["step"] for m in resumed.history] == [4]
    assert _steps(out / "metrics.jsonl") == [1, 2, 3, 4]  # the torn line went, the redone step is logged once
    assert _steps(out / "eval.jsonl") == [1, 2, 3, 4]
