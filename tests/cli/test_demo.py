"""`liger-models demo --quick`: the README's first command, at test size (the full demo is the same code path)."""

from __future__ import annotations

import json
import shlex

import pytest

from liger_models.cli import build_parser, main
from liger_models.medusa import MedusaModel
from liger_models.recipes import run_demo

pytestmark = pytest.mark.usefixtures("reference_path")


def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    result = run_demo(build_parser().parse_args(["demo", "--quick", "--output-dir", str(out), "--device", "cpu"]))
    printed = capsys.readouterr().out
    for text in ("top-1 after training", "tokens per base-model forward", "Medusa heads:", "sample"):
        assert text in printed
    assert len(result["after"]["top1"]) == 3 and all(0 <= a <= 1 for a in result["after"]["top5"])
    assert result["after"]["tokens"] > 0 and result["tokens_per_step"] >= 1.0
    assert result["lossless"]  # greedy Medusa decoding reproduces greedy decoding, with either tree
    assert result["fitted_tokens_per_step"] >= 1.0 and "calibrate-tree" in printed
    saved = json.loads((result["heads_dir"] / "medusa_choices.json").read_text())["medusa_choices"]
    assert [tuple(c) for c in saved] == result["fitted_tree"]
    heads = MedusaModel.from_pretrained(str(result["heads_dir"]))  # the base is found via base_model_name_or_path
    assert heads.config.num_heads == 3
    assert json.loads((result["heads_dir"] / "config.json").read_text())["medusa_num_heads"] == 3
    # The decode command it prints runs as printed: Medusa decoding of its prompt beside plain decoding.
    command = next(line for line in printed.splitlines() if line.startswith("decode:"))
    argv = shlex.split(command.removeprefix("decode:"))
    assert argv[:2] == ["liger-models", "generate"] and str(result["heads_dir"]) in argv
    assert main([*argv[1:], "--device", "cpu", "--max-new-tokens", "6"]) == 0
    decoded = capsys.readouterr().err
    assert "[medusa]" in decoded and "calibrated tree" in decoded and "identical tokens: True" in decoded

    # Running again into the same directory replaces the previous demo; a foreign directory is refused.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path / "mine")]) == 2
    assert "was not made by `liger-models demo`" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_init_model_cli(tmp_path):
    assert main(["init-model", "--output-dir", str(tmp_path / "m"), "--tokenizer-vocab", "300"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["vocab_size"] == 300 and config["dtype"] == "bfloat16"
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert main(["init-model", "--preset", "nope", "--output-dir", str(tmp_path / "x")]) == 2


def test_init_model_refuses_to_overwrite_a_model(tmp_path, capsys):
    """Random weights must not silently replace a (possibly trained) model in the output directory."""
    assert main(["init-model", "--output-dir", str(tmp_path / "m"), "--tokenizer-vocab", "300"]) == 0
    before = (tmp_path / "m" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["init-model", "--output-dir", str(tmp_path / "m"), "--tokenizer-vocab", "300", "--seed", "1"]) == 2
    assert "already holds a model" in capsys.readouterr().err
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before


def test_init_model_refuses_a_tokenizer_dir_and_a_file(tmp_path, capsys):
    """A directory holding only a tokenizer keeps it (init-model trained a new one over it); a file as the output
    directory gets the one-line error, not a raw OS error."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert main(["init-model", "--output-dir", str(tmp_path / "tok"), "--tokenizer-vocab", "300"]) == 2
    assert "already holds a model or tokenizer" in capsys.readouterr().err
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == "{}"
    (tmp_path / "tok_config").mkdir()  # a tokenizer_config.json alone (its chat template, say) is kept too
    (tmp_path / "tok_config" / "tokenizer_config.json").write_text("{}")
    assert main(["init-model", "--output-dir", str(tmp_path / "tok_config"), "--tokenizer-vocab", "300"]) == 2
    assert "already holds a model or tokenizer" in capsys.readouterr().err
    assert (tmp_path / "tok_config" / "tokenizer_config.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    assert main(["init-model", "--output-dir", str(tmp_path / "file"), "--tokenizer-vocab", "300"]) == 2
    err = capsys.readouterr().err
    assert "a file, not a directory" in err and "Errno" not in err


def test_demo_on_its_own_pretrained_model_keeps_it(tmp_path, capsys):
    """`demo --model DIR` with the "base model:" path an earlier demo printed (inside the same --output-dir) trains
    heads on it: replacing the earlier demo's output deleted that model before it was loaded. A --model that does
    not exist is refused before the earlier output is touched."""
    out = tmp_path / "demo"
    first = run_demo(build_parser().parse_args(["demo", "--quick", "--output-dir", str(out), "--device", "cpu",
                                                "--medusa-steps", "1"]))
    base = first["model_dir"]
    assert main(["demo", "--quick", "--output-dir", str(out), "--model", str(tmp_path / "nowhere")]) == 2
    assert "--model" in capsys.readouterr().err and base.is_dir() and (out / "medusa").is_dir()
    assert main(["demo", "--quick", "--output-dir", str(out), "--device", "cpu", "--model", str(base),
                 "--medusa-steps", "1"]) == 0
    assert (base / "config.json").is_file()


def test_demo_refuses_pretrain_steps_with_a_model(tmp_path, capsys):
    """--model skips the demo's pre-training, so --pretrain-steps would be ignored without a word: refused before
    anything is written."""
    out = tmp_path / "demo"
    model = tmp_path / "model"
    model.mkdir()
    assert main(["demo", "--quick", "--output-dir", str(out), "--model", str(model), "--pretrain-steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "--pretrain-steps" in err and "--model" in err
    assert not out.exists()
