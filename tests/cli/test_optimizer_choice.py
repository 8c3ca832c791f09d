"""`--optimizer`: bitsandbytes' AdamW variants through the real CLI on a tiny model (CPU): they train (full and LoRA,
Medusa's heads), checkpoint bitsandbytes' own state, resume bit for bit; a resume into another optimizer is refused
or, when allowed, starts its state afresh; what they cannot go with fails before anything is loaded."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from liger_models.cli import main
from liger_models.train import checkpointing as ckpt
from tests.lora.bnb import import_bnb

pytestmark = [pytest.mark.usefixtures("reference_path"),
              pytest.mark.skipif(import_bnb() is None, reason="bitsandbytes does not import here")]

RUN = ["--seq-len", "32", "--batch-size", "2", "--dtype", "fp32", "--quiet", "--device", "cpu", "--lr", "3e-3",
       "--max-steps", "4", "--save-every", "2", "--warmup-steps", "1"]


def _last(out, name):
    return out / "checkpoints" / ckpt.step_dir_name(4) / name


@pytest.mark.parametrize("command, name, extra, saved", [
    ("train", "adamw_8bit", [], "model.safetensors"),
    ("train", "paged_adamw_32bit", [], "model.safetensors"),
    ("train", "paged_adamw_8bit", ["--lora-r", "4"], "adapter_model.safetensors"),
    ("train-medusa", "adamw_8bit", ["--num-heads", "2"], "medusa_lm_head.safetensors"),
])
def test_trains_keeps_bitsandbytes_state_and_resumes_bit_for_bit(command, name, extra, saved, tiny_model_dir,
                                                                  text_file, tmp_path):
    out = tmp_path / "run"
    argv = [command, "--model", str(tiny_model_dir), "--data", str(text_file), *RUN, *extra, "--optimizer", name]
    assert main([*argv, "--output-dir", str(out)]) == 0
    state = ckpt.load_trainer_state(out / "checkpoints" / ckpt.step_dir_name(4))["optimizer"]["state"]
    assert state, "the optimizer state is saved"
    bytes_per_moment = []
    for key, moments in state.items():
        quant = moments["__bnb_optimizer_quant_state__"]  # bitsandbytes' own state_dict layout
        assert moments["step"] == 4
        # 8 bits from bitsandbytes' min_8bit_size (4096 elements) on: the tiny model's matrices, not its adapters;
        # the embeddings keep 32 bits
        eight = name.endswith("8bit") and quant["state1"].numel() >= 4096 and "embed_tokens" not in key
        assert quant["state1"].dtype.itemsize == (1 if eight else 4), key
        bytes_per_moment.append(quant["state1"].dtype.itemsize)
    assert (1 in bytes_per_moment) == (name.endswith("8bit") and "--lora-r" not in extra)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(loss == loss for loss in losses)

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / ckpt.step_dir_name(4))
    assert main([*argv, "--output-dir", str(resumed), "--resume", "auto"]) == 0
    assert _last(resumed, saved).read_bytes() == _last(out, saved).read_bytes()
    again = ckpt.load_trainer_state(resumed / "checkpoints" / ckpt.step_dir_name(4))["optimizer"]["state"]
    for key, moments in state.items():
        for part, tensor in moments["__bnb_optimizer_quant_state__"].items():
            assert tensor.equal(again[key]["__bnb_optimizer_quant_state__"][part]), (key, part)


def test_resume_into_another_optimizer(tiny_model_dir, text_file, tmp_path, capsys):
    """Refused by name, the checkpoint's optimizer first; allowed, the moments start from zero and the run says so
    (the 8-bit state after one resumed step is that of a first step, not of the checkpoint's third)."""
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_model_dir), "--data", str(text_file), "--output-dir", str(out), *RUN]
    assert main([*argv, "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--optimizer", "adamw_8bit", "--resume", "auto"]) == 2
    assert "optimizer adamw → adamw_8bit" in capsys.readouterr().err
    assert main([*argv, "--optimizer", "adamw_8bit", "--resume", "auto",
                 "--allow-changed-settings", "optimizer"]) == 0
    assert "the optimizer's state starts from zero" in capsys.readouterr().err
    state = ckpt.load_trainer_state(out / "checkpoints" / ckpt.step_dir_name(4))["optimizer"]["state"]
    assert {moments["step"] for moments in state.values()} == {2}
    assert load_file(_last(out, "model.safetensors"))  # the run went on to its end


@pytest.mark.parametrize("flags, problem", [
    (["--cuda-graph"], "--cuda-graph (its step is not capturable)"),
    (["--adamw", "torch"], "--adamw torch"),
])
def test_conflicts_fail_before_loading(flags, problem, text_file, tmp_path, capsys):
    code = main(["train", "--model", str(tmp_path / "not-loaded"), "--data", str(text_file), "--output-dir",
                 str(tmp_path / "out"), "--optimizer", "adamw_8bit", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "--optimizer adamw_8bit is bitsandbytes' optimizer" in err and problem in err, err
    assert not (tmp_path / "out").exists()


def test_fsdp2_is_refused(text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: the check runs before any process group
    assert main(["train", "--model", str(tmp_path / "m"), "--data", str(text_file), "--optimizer",
                 "paged_adamw_32bit", "--output-dir", str(tmp_path / "out")]) == 2
    assert "FSDP2 (several processes" in capsys.readouterr().err
