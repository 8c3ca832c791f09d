"""The `liger-models` CLI end to end on a tiny model directory, its help, and its errors."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.cli import main
from liger_models.medusa import MedusaModel

pytestmark = pytest.mark.usefixtures("reference_path")

SMALL = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "3", "--save-every", "2", "--quiet"]


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Tell me line {i}."},
                          {"role": "assistant", "content": "Now is the winter of our discontent " * (1 + i % 3)}]}
            for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_commands_and_options(capsys):
    out = _help(["train-medusa"], capsys)
    for option in ("--stage", "--num-heads", "--share-lm-head", "--head-lr-multiplier", "--schedule", "--lambda0",
                   "--decay", "--activation-checkpointing", "--resume", "--grad-accum", "--dtype"):
        assert option in out
    top = _help([], capsys)
    assert all(command in top for command in ("demo", "train-medusa", "generate", "chat", "calibrate-tree", "torchrun"))
    generate = _help(["generate"], capsys)
    for option in ("--medusa", "--prompt", "--prompt-file", "--chat", "--compare", "--temperature", "--top-p"):
        assert option in generate
    assert "--quick" in _help(["demo"], capsys)


def test_train_then_medusa_stage1_then_stage2(tiny_model_dir, text_file, chat_file, tmp_path):
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(text_file), "--output-dir",
                 str(tmp_path / "lm"), *SMALL]) == 0
    lm_ckpt = tmp_path / "lm" / "checkpoints" / "step_000003"
    assert (lm_ckpt / "tokenizer.json").is_file()
    AutoLigerForCausalLM.from_pretrained(lm_ckpt)  # a plain HF model directory

    assert main(["train-medusa", "--model", str(lm_ckpt), "--data", str(chat_file), "--num-heads", "2",
                 "--share-lm-head", "--output-dir", str(tmp_path / "s1"), *SMALL]) == 0
    heads = tmp_path / "s1" / "checkpoints" / "step_000003"
    config = json.loads((heads / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["version"] == "2"
    assert config["base_model_name_or_path"] == str(lm_ckpt)
    assert MedusaModel.from_pretrained(str(heads)).heads.num_heads == 2  # the base is found from the config
    metrics = [json.loads(line) for line in (tmp_path / "s1" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and len(metrics[-1]["head_top1"]) == 2 and metrics[-1]["base_loss"] is None

    assert main(["train-medusa", "--model", str(lm_ckpt), "--data", str(chat_file), "--stage", "2",
                 "--init-heads", str(heads), "--schedule", "sine_0.5", "--output-dir", str(tmp_path / "s2"),
                 *SMALL]) == 0
    joint = tmp_path / "s2" / "checkpoints" / "step_000003"
    stage2 = MedusaModel.from_pretrained(str(joint))
    assert stage2.stage == 2 and stage2.config.scheduler == "sine_0.5"
    # The checkpoint was written into a temporary directory, then renamed: its config names where it lives now.
    assert json.loads((joint / "config.json").read_text())["base_model_name_or_path"] == str(joint.resolve())
    start = MedusaModel.from_pretrained(str(heads))
    # Stage 2 started from the stage-1 heads and trained the base as well.
    assert not torch.equal(stage2.base.model.layers[0].mlp.down_proj.weight,
                           start.base.model.layers[0].mlp.down_proj.weight)
    last = json.loads((tmp_path / "s2" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["base_loss"] is not None and len(last["lrs"]) == 2
    assert last["lrs"][0] == pytest.approx(4 * last["lrs"][1])  # heads at 4× the base LR


def test_console_script_runs(tiny_model_dir, text_file, tmp_path):
    exe = shutil.which("liger-models")
    cmd = [exe] if exe else [sys.executable, "-m", "liger_models.cli"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([*cmd, "train-medusa", "--model", str(tiny_model_dir), "--data", str(text_file),
                           "--num-heads", "2", "--output-dir", str(tmp_path / "run"), "--seq-len", "32",
                           "--batch-size", "2", "--max-steps", "2", "--log-every", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 2/2" in proc.stderr and "heads top1/top5%" in proc.stderr
    assert "checkpoint:" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--data", "{missing}"], "no such file"),
    (["--data", "{csv}"], "expected a .txt or .jsonl"),
    (["--model", "{tmp}/nowhere/model"], "no such directory"),
    (["--model", "{tmp}"], "no config.json"),
    (["--resume", "{tmp}/nope"], "--resume"),
    (["--init-heads", "{tmp}/nope"], "--init-heads"),
])
def test_bad_paths_fail_clearly(argv, message, tiny_model_dir, text_file, tmp_path, capsys):
    (tmp_path / "x.csv").write_text("a")
    fill = {"missing": tmp_path / "missing.txt", "csv": tmp_path / "x.csv", "tmp": tmp_path}
    argv = [a.format(**fill) for a in argv]
    base = {"--model": str(tiny_model_dir), "--data": str(text_file)}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    full = ["train-medusa", "--output-dir", str(tmp_path / "out"), *[x for kv in base.items() for x in kv]]
    code, err = _code_and_error(full, capsys)
    # Exit code 2 as for every other user error (argparse's, main's): these exited 1.
    assert code == 2 and message in err and err.startswith("liger-models: error: ")


@pytest.mark.parametrize("where", ["model", "empty"])
def test_init_heads_without_heads_fails_before_loading_anything(where, tiny_model_dir, text_file, tmp_path, capsys,
                                                                 monkeypatch):
    """--init-heads naming the base model's directory (or an empty one) is refused by name, before the base model
    is loaded (minutes for a large one), not with a bare file error after it."""
    from liger_models import AutoLigerForCausalLM

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --init-heads was checked")

    monkeypatch.setattr(AutoLigerForCausalLM, "from_pretrained", no_loading)
    (tmp_path / "empty").mkdir()
    heads = tiny_model_dir if where == "model" else tmp_path / "empty"
    code, err = _code_and_error(["train-medusa", "--model", str(tiny_model_dir), "--data", str(text_file),
                                 "--output-dir", str(tmp_path / "out"), "--init-heads", str(heads)], capsys)
    assert code == 2 and f"--init-heads {heads}: no Medusa heads" in err


def _code_and_error(argv, capsys) -> tuple:
    """(exit code, stderr) of the CLI, whether it returned the code or raised SystemExit with the message."""
    try:
        code = main(argv)
    except SystemExit as exc:
        return exc.code, str(exc)
    return code, capsys.readouterr().err


def test_bad_arguments_are_rejected(tiny_model_dir, text_file, capsys):
    for bad in (["--schedule", "cosine"], ["--stage", "3"], ["--batch-size", "0"]):
        with pytest.raises(SystemExit) as info:
            main(["train-medusa", "--model", str(tiny_model_dir), "--data", str(text_file), *bad])
        assert info.value.code == 2
    assert "unknown Medusa scheduler" in capsys.readouterr().err


def test_data_that_does_not_fit_the_model_fails_clearly(tiny_model_dir, tmp_path, capsys):
    # A model whose vocabulary is smaller than its tokenizer's.
    small = tmp_path / "small_vocab"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 64
    (small / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    sd = load_file(small / "model.safetensors")
    sd = {k: (v[:64].clone() if v.shape[0] == 320 else v) for k, v in sd.items()}
    save_file(sd, small / "model.safetensors")
    (tmp_path / "t.txt").write_text("Now is the winter of our discontent")
    code = main(["train", "--model", str(small), "--data", str(tmp_path / "t.txt"), "--output-dir",
                 str(tmp_path / "o"), "--seq-len", "8", "--max-steps", "1"])
    assert code == 2 and "vocab_size is 64" in capsys.readouterr().err


def test_loss_options_are_the_runs_only():
    """--loss-scratch-mib and --loss-grad-filter-eps set linear-CE's max_scratch_bytes and grad_filter_eps settings
    around the training loop and restore them, also on error."""
    from liger_models.cli import build_parser
    from liger_models.kernels.ops import fused_linear_cross_entropy as flce
    from liger_models.recipes.training import loss_options as _loss_options

    for command in ("train", "train-medusa"):
        args = build_parser().parse_args([command, "--model", "m", "--data", "d.txt", "--loss-scratch-mib", "512",
                                          "--loss-grad-filter-eps", "2.44e-4"])
        assert args.loss_scratch_mib == 512 and args.loss_grad_filter_eps == 2.44e-4
    for bad in (["--loss-scratch-mib", "0"], ["--loss-grad-filter-eps", "0"], ["--loss-grad-filter-eps", "1"],
                ["--loss-grad-filter-eps", "nan"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "--model", "m", "--data", "d.txt", *bad])
    before = flce.TUNING.max_scratch_bytes, flce.TUNING.grad_filter_eps
    with _loss_options(512, 1e-3):
        assert (flce.TUNING.max_scratch_bytes, flce.TUNING.grad_filter_eps) == (512 << 20, 1e-3)
    assert (flce.TUNING.max_scratch_bytes, flce.TUNING.grad_filter_eps) == before
    with pytest.raises(KeyError), _loss_options(8, 1e-3):
        raise KeyError("interrupted")
    assert (flce.TUNING.max_scratch_bytes, flce.TUNING.grad_filter_eps) == before
    with _loss_options(None, None):
        assert (flce.TUNING.max_scratch_bytes, flce.TUNING.grad_filter_eps) == before


def test_adamw_choice():
    """--adamw picks the CUDA step (FusedAdamW or torch's fused AdamW); on the CPU both build torch's AdamW."""
    from liger_models.cli import build_parser
    from liger_models.train.optim import FusedAdamW, build_adamw

    parse = build_parser().parse_args
    assert parse(["train", "--model", "m", "--data", "d.txt"]).adamw == "liger"
    assert parse(["train-medusa", "--model", "m", "--data", "d.txt", "--adamw", "torch"]).adamw == "torch"
    with pytest.raises(SystemExit):
        parse(["train", "--model", "m", "--data", "d.txt", "--adamw", "sgd"])
    for kernel in (True, False):
        opt = build_adamw([{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 1e-3}], kernel=kernel)
        assert type(opt) is torch.optim.AdamW and not isinstance(opt, FusedAdamW)


@pytest.mark.parametrize("bad, message", [
    (["--min-lr-ratio", "-0.5"], "--min-lr-ratio"),  # would end the cosine at a negative LR: gradient ascent
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio"),
    (["--lr", "-0.001"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--beta1", "1"], "--beta1"),
    (["--beta2", "-0.1"], "--beta2"),
    (["--adam-eps", "0"], "--adam-eps"),
    (["--max-grad-norm", "-1"], "--max-grad-norm"),
    (["--seq-len", "1"], "--seq-len"),  # nothing to predict in a 1-token window
    (["--head-lr-multiplier", "0"], "--head-lr-multiplier"),
])
def test_bad_numbers_are_rejected_by_the_parser(bad, message, capsys):
    command = "train-medusa" if bad[0] == "--head-lr-multiplier" else "train"
    with pytest.raises(SystemExit) as info:
        main([command, "--model", "m", "--data", "d.txt", *bad])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags, problem", [
    (["--optimizer-in-backward", "--max-grad-norm", "0", "--grad-accum", "2"], "gradient accumulation"),
    (["--optimizer-in-backward"], "clipping"),
    (["--cuda-graph", "--device", "cpu"], "a CPU device"),
    (["--cuda-graph", "--activation-checkpointing"], "--activation-checkpointing"),
    (["--cuda-graph", "--mlp-chunk-tokens", "16"], "--mlp-chunk-tokens"),
    (["--eval-every", "5"], "--eval-every needs --eval-data"),  # would silently never evaluate
    (["--eval-batches", "5"], "--eval-batches needs --eval-data"),  # the same
    (["--max-steps", "10", "--warmup-steps", "20"], "--warmup-steps 20"),  # the LR would never reach --lr
    (["--stage", "1", "--base-loss-weight", "0.5"], "stage 2"),  # stage 1 has no base loss: silently ignored
    (["--data-cache", "cache", "--no-data-cache"], "contradict"),
])
def test_conflicting_options_fail_before_any_work(flags, problem, text_file, tmp_path, capsys, monkeypatch):
    """Options that cannot go together are refused before the model is loaded and the data tokenized (minutes
    for a large model), with the one-line error."""
    from liger_models.recipes import finetune, medusa, training

    def no_work(*args, **kwargs):
        raise AssertionError("the run started loading before refusing its options")

    monkeypatch.setattr(finetune, "resolve_model", no_work)
    monkeypatch.setattr(medusa, "resolve_model", no_work)
    monkeypatch.setattr(training.D, "init_distributed", no_work)
    for command in ("train", "train-medusa") if "--stage" not in flags else ("train-medusa",):
        code = main([command, "--model", "m", "--data", str(text_file), "--output-dir", str(tmp_path), *flags])
        assert code == 2 and problem in capsys.readouterr().err


def _train(model_dir, data, out, *extra) -> int:
    return main(["train", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--seq-len", "32",
                 "--batch-size", "2", "--dtype", "fp32", "--quiet", *extra])


def _logged_lrs(out) -> list[float]:
    return [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _cosine(progress: float, floor: float = 0.1) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup, factors", [
    ("2", [0.5, 1.0, _cosine(1 / 4), _cosine(2 / 4), _cosine(3 / 4), 0.1]),
    ("0", [1.0, *(_cosine(k / 5) for k in range(1, 5)), 0.1]),
])
def test_lr_schedule_starts_above_zero_and_ends_at_the_floor(warmup, factors, tiny_model_dir, text_file, tmp_path):
    """--min-lr-ratio is the final LR / peak LR: the last of --max-steps steps trains at the floor (it trained a
    quarter of the way up the 6-step cosine: the floor fell on a step max_steps + 1 that never runs, and the peak was
    used twice, by the warmup's last step and the cosine's first); the warmup's first step trains at peak / warmup,
    not 0."""
    assert _train(tiny_model_dir, text_file, tmp_path, "--max-steps", "6", "--save-every", "0", "--lr", "1e-3",
                  "--warmup-steps", warmup, "--min-lr-ratio", "0.1") == 0
    assert _logged_lrs(tmp_path) == pytest.approx([1e-3 * f for f in factors], rel=1e-9, abs=0)


def _logged_losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_mlp_chunks_train_as_the_whole_mlp(tiny_model_dir, text_file, tmp_path, monkeypatch):
    """--mlp-chunk-tokens with --activation-checkpointing: chunks of 24 of a batch's 64 rows (the last one short),
    the same losses step after step as the whole MLP."""
    from liger_models.modules.decoder import DecoderLayer

    common = ("--max-steps", "3", "--save-every", "0", "--log-every", "1", "--activation-checkpointing")
    assert _train(tiny_model_dir, text_file, tmp_path / "whole", *common) == 0
    chunk_rows = []
    mlp_rows = DecoderLayer._mlp_rows
    monkeypatch.setattr(DecoderLayer, "_mlp_rows", lambda self, rows: (chunk_rows.append(len(rows)),
                                                                        mlp_rows(self, rows))[1])
    assert _train(tiny_model_dir, text_file, tmp_path / "chunks", *common, "--mlp-chunk-tokens", "24") == 0
    assert set(chunk_rows) == {24, 16}
    whole, chunks = _logged_losses(tmp_path / "whole"), _logged_losses(tmp_path / "chunks")
    assert len(whole) == 3 and chunks == pytest.approx(whole, rel=1e-5, abs=0)


def test_resume_takes_this_runs_optimizer_settings(tiny_model_dir, text_file, tmp_path):
    """A resumed run allowed to change them (--allow-changed-settings) trains at its own --lr, --weight-decay,
    --beta1/--beta2, --adam-eps, as it follows its own --max-steps: the optimizer's and the scheduler's state dicts
    carry the checkpoint's, which silently replaced them."""
    from liger_models.train.optim import warmup_cosine_factor

    common = ("--save-every", "0", "--warmup-steps", "1")
    assert _train(tiny_model_dir, text_file, tmp_path, *common, "--max-steps", "3", "--lr", "3e-3") == 0
    assert _train(tiny_model_dir, text_file, tmp_path, *common, "--max-steps", "5", "--lr", "1e-3",
                  "--weight-decay", "0.25", "--beta2", "0.99", "--adam-eps", "1e-6", "--resume", "auto",
                  "--allow-changed-settings", "lr,weight-decay,beta2,adam-eps") == 0
    assert _logged_lrs(tmp_path)[3:] == pytest.approx([1e-3 * warmup_cosine_factor(s, 1, 5) for s in (3, 4)])
    state = torch.load(tmp_path / "checkpoints" / "step_000005" / "trainer_state.pt", weights_only=True)
    groups = {g["name"]: g for g in state["optimizer"]["param_groups"]}
    assert groups["decay"]["weight_decay"] == 0.25 and groups["no_decay"]["weight_decay"] == 0.0
    assert all(tuple(g["betas"]) == (0.9, 0.99) and g["eps"] == 1e-6 for g in groups.values())
    assert state["scheduler"]["base_lrs"] == [1e-3, 1e-3]


def test_resume_past_max_steps_fails_clearly(tiny_model_dir, text_file, tmp_path, capsys):
    """--max-steps below the checkpoint's step cannot be honoured: an error, not a run that does nothing, says
    "done: 4 steps" and exits 0."""
    assert _train(tiny_model_dir, text_file, tmp_path, "--max-steps", "4", "--save-every", "0") == 0
    capsys.readouterr()
    assert _train(tiny_model_dir, text_file, tmp_path, "--max-steps", "2", "--resume", "auto") == 2
    assert "--max-steps 2" in capsys.readouterr().err
    assert _train(tiny_model_dir, text_file, tmp_path, "--max-steps", "4", "--resume", "auto") == 0  # finished: fine


def test_device_cuda_without_cuda_fails_clearly(text_file, tmp_path, capsys, monkeypatch):
    """--device cuda on a machine without CUDA: the one-line error and exit code 2 before any work, not a
    RuntimeError traceback (train, train-medusa, demo: after training a tokenizer and writing its output directory;
    init-model: torch's "not compiled with CUDA" AssertionError)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["train", "--model", "m", "--data", str(text_file)],
                 ["train-medusa", "--model", "m", "--data", str(text_file)],
                 ["demo", "--quick"], ["init-model"]):
        out = tmp_path / argv[0]
        assert main([*argv, "--output-dir", str(out), "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
        assert not out.exists()


def test_path_that_is_not_a_directory_fails_clearly(tiny_model_dir, text_file, tmp_path, capsys):
    """A file where a directory belongs (--model, --output-dir) gets the one-line error, not a NotADirectoryError
    traceback."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    for argv in (["train", "--model", str(tiny_model_dir), "--data", str(text_file), "--output-dir", str(a_file)],
                 ["train", "--model", str(text_file), "--data", str(text_file), "--output-dir", str(tmp_path / "o")],
                 ["demo", "--quick", "--output-dir", str(a_file)]):
        code, err = _code_and_error(argv, capsys)
        assert code not in (0, None) and "liger-models: error:" in err and "Traceback" not in err
        assert a_file.read_text() == "not a directory"


def test_diverged_loss_fails_clearly(tiny_model_dir, text_file, tmp_path, capsys):
    """A loss that turns NaN stops the run with its "lower --lr?" advice as the one-line error and exit code 2,
    not a FloatingPointError traceback."""
    code = _train(tiny_model_dir, text_file, tmp_path, "--max-steps", "8", "--lr", "1e30", "--warmup-steps", "0",
                  "--max-grad-norm", "0")
    assert code == 2 and "lower --lr?" in capsys.readouterr().err
    # The diverged step is logged too, in strict JSON (null, not NaN, which strict readers refuse).
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1], parse_constant=lambda name: pytest.fail(f"non-JSON constant {name} in metrics"))
    assert last["loss"] is None and last["step"] == len(lines)


def test_metrics_lines_are_strict_json():
    from liger_models.train.trainer import json_line

    line = json_line({"loss": float("nan"), "head_top1": [0.5, float("inf")], "nested": {"x": -float("inf")}, "n": 3})
    assert line.endswith("\n") and "\n" not in line[:-1]
    assert json.loads(line, parse_constant=lambda name: pytest.fail(name)) == {
        "loss": None, "head_top1": [0.5, None], "nested": {"x": None}, "n": 3}


def test_bad_integer_names_its_type(capsys):
    """argparse names an integer option's type in its error: "int", not the checking function's name."""
    for flag in ("--max-steps", "--eval-every", "--seq-len"):
        with pytest.raises(SystemExit):
            main(["train", "--model", "m", "--data", "d.txt", flag, "ten"])
        err = capsys.readouterr().err
        assert f"argument {flag}: invalid int value: 'ten'" in err, err


def _medusa(model_dir, data, out, *extra) -> list[str]:
    return ["train-medusa", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--seq-len",
            "32", "--batch-size", "2", "--max-steps", "2", "--num-heads", "2", "--quiet", *extra]


def test_resume_of_another_kind_of_run_fails_clearly(tiny_model_dir, text_file, tmp_path, capsys):
    """--resume of a checkpoint written by another command or Medusa stage gets the one-line error and leaves the
    run's checkpoints alone: stage 2 on a stage-1 checkpoint was an optimizer-state traceback, and stage 1 on a
    stage-2 checkpoint silently dropped the trained base and overwrote the run with heads only."""
    runs = {"train": tmp_path / "lm", "1": tmp_path / "s1", "2": tmp_path / "s2"}
    assert _train(tiny_model_dir, text_file, runs["train"], "--max-steps", "2") == 0
    assert main(_medusa(tiny_model_dir, text_file, runs["1"])) == 0
    assert main(_medusa(tiny_model_dir, text_file, runs["2"], "--stage", "2")) == 0
    capsys.readouterr()
    for made_by, out in runs.items():
        before = sorted(p.name for p in (out / "checkpoints").iterdir())
        for kind in runs:
            if kind == made_by:
                continue
            if kind == "train":
                argv = ["train", "--model", str(tiny_model_dir), "--data", str(text_file), "--output-dir", str(out),
                        "--seq-len", "32", "--batch-size", "2", "--max-steps", "4", "--quiet"]
            else:
                argv = [*_medusa(tiny_model_dir, text_file, out, "--stage", kind), "--max-steps", "4"]
            code, err = _code_and_error([*argv, "--resume", "auto"], capsys)
            assert code == 2 and "was written by" in err and "Traceback" not in err, (made_by, kind, err)
            assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_head_shape_options_that_disagree_with_loaded_heads_fail(tiny_model_dir, text_file, tmp_path, capsys):
    """--num-heads, --num-layers and --share-lm-head given with --init-heads (or on resume) must match the heads
    loaded: they were silently ignored, so a run asked for 3 heads trained the file's 2."""
    heads = tmp_path / "s1" / "checkpoints" / "step_000002"
    assert main(_medusa(tiny_model_dir, text_file, tmp_path / "s1")) == 0
    capsys.readouterr()
    for flags, problem in ((["--num-heads", "3"], "--num-heads 3"), (["--num-layers", "2"], "--num-layers 2"),
                           (["--share-lm-head"], "--share-lm-head")):
        argv = [*_medusa(tiny_model_dir, text_file, tmp_path / "s2", "--stage", "2"), "--init-heads", str(heads)]
        code, err = _code_and_error([*argv, *flags], capsys)
        assert code == 2 and problem in err and "--init-heads" in err, err
        code, err = _code_and_error([*_medusa(tiny_model_dir, text_file, tmp_path / "s1"), "--max-steps", "3",
                                     "--resume", "auto", *flags], capsys)
        assert code == 2 and problem in err, err
    # Options that agree with the heads are fine (the default --num-heads 5 is not "given").
    argv = [*_medusa(tiny_model_dir, text_file, tmp_path / "s2", "--stage", "2"), "--init-heads", str(heads)]
    assert main(argv) == 0
