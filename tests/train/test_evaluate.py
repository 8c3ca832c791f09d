"""Held-out evaluation during training (liger_models/train/evaluate.py, --eval-data)."""

from __future__ import annotations

import json

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.hub import load_tokenizer
from liger_models.train.data import build_dataset, read_special_tokens
from liger_models.recipes import train_causal_lm, train_medusa
from tests.train.test_trainer import _args, run_until_crash

pytestmark = pytest.mark.usefixtures("reference_path")

EVAL = ("--eval-every", "2", "--eval-batches", "3")


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    from tests.helpers import shakespeare

    path = tmp_path_factory.mktemp("eval") / "held_out.txt"
    path.write_text(shakespeare(20_000)[12_000:], encoding="utf-8")  # text the training file does not hold
    return path


def test_eval_loss_is_the_mean_over_the_eval_windows(tiny_model_dir, text_file, eval_file, tmp_path):
    """Evaluations at steps 2, 4, 6; the last equals the final checkpoint's mean loss over the first 3 × B eval
    windows; training itself is unchanged by evaluating (same losses as a run without --eval-data)."""
    run = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "a", "--eval-data", str(eval_file),
                                *EVAL))
    plain = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "b"))
    assert [m["loss"] for m in run.history] == [m["loss"] for m in plain.history]
    assert not (tmp_path / "b" / "eval.jsonl").exists()  # no --eval-data: no (empty) eval log
    logged = [json.loads(line) for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [2, 4, 6] and logged == run.evals
    assert logged[-1]["loss"] < logged[0]["loss"]  # the model learns something that carries over

    tokenizer = load_tokenizer(tiny_model_dir)
    data = build_dataset([eval_file], tokenizer, read_special_tokens(tokenizer, tiny_model_dir), 32, "auto")
    batch = data.batch(torch.arange(3 * 2))  # 3 rounds of --batch-size 2 on one process
    model = AutoLigerForCausalLM.from_pretrained(run.checkpoint)
    with torch.no_grad():
        loss = model(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"]).loss
    torch.testing.assert_close(torch.tensor(logged[-1]["loss"]), loss, rtol=1e-5, atol=1e-6)


def test_medusa_eval_reports_each_head_and_survives_a_resume(tiny_model_dir, text_file, eval_file, tmp_path,
                                                              monkeypatch):
    extra = ("--stage", "1", "--num-heads", "2", "--eval-data", str(eval_file), *EVAL)
    full = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "full", *extra))
    assert [m["step"] for m in full.evals] == [2, 4, 6]
    for m in full.evals:
        assert len(m["head_top1"]) == len(m["head_top5"]) == 2 and m["base_loss"] is None
        assert all(0 <= a <= b <= 1 for a, b in zip(m["head_top1"], m["head_top5"]))

    run_until_crash(monkeypatch, lambda: train_medusa(_args("train-medusa", tiny_model_dir, text_file,
                                                            tmp_path / "cut", *extra)), after_step=4)
    # The cut run logged evals at 2 and 4 and checkpointed at 3: the resumed run recomputes from step 4 on.
    resumed = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path / "cut", *extra,
                                 "--resume", "auto"))
    logged = [json.loads(line) for line in (tmp_path / "cut" / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [2, 4, 6]
    assert logged[1:] == resumed.evals and [m["loss"] for m in logged] == [m["loss"] for m in full.evals]


def test_eval_data_too_small_fails_clearly(tiny_model_dir, text_file, tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("To be.", encoding="utf-8")
    with pytest.raises(ValueError, match="eval data packs into 1 windows"):
        train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "x", "--eval-data", str(tiny)))
