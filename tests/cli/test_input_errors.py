"""A malformed file of every kind the package reads fails at the CLI with one line that names the file, the line
where there is one, and the problem: exit code 2, no traceback.

The kinds: a model's config.json, generation_config.json, tokenizer.json, tokenizer_config.json, chat templates
(chat_template.jinja, chat_template.json), safetensors headers and index; training data (.txt, .jsonl); Medusa heads
(config.json, the heads file, medusa_choices.json); prompt files; convert-native's params.json. special_tokens_map.json
is copied with a checkpoint's tokenizer but never read (the special tokens come from tokenizer_config.json).
"""

from __future__ import annotations

import json
import shutil

import pytest

from liger_models.cli import main

pytestmark = pytest.mark.usefixtures("reference_path")

CHAT_ROW = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well met."}]}


@pytest.fixture
def model(tiny_model_dir, tmp_path):
    """A private copy of the tiny model directory, to break."""
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def _fails(argv, capsys) -> str:
    """The CLI's one-line error for ``argv`` (exit code 2, nothing else on stderr)."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liger-models: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _train(model, data, tmp_path, capsys) -> str:
    return _fails(["train", "--model", str(model), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                   "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--quiet", "--no-data-cache",
                   "--device", "cpu"], capsys)


def _generate(model, tmp_path, capsys, *extra) -> str:
    return _fails(["generate", "--model", str(model), "--prompt", "ROMEO:", "--max-new-tokens", "2", "--device", "cpu",
                   *extra], capsys)


def _json_file(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("name, text, problem", [
    ("config.json", '{"model_type": "llama",', "not valid JSON: Expecting property name enclosed in double quotes at "
                                                "line 1"),
    ("config.json", "[]", "not a JSON object (got list)"),
    ("tokenizer_config.json", '{"eos_token": "x",\n', "not valid JSON: Expecting property name enclosed in double "
                                                      "quotes at line 2"),
    ("tokenizer_config.json", '"x"', "not a JSON object (got str)"),
    ("chat_template.json", '{"chat_template": ', "not valid JSON: Expecting value at line 1 column 19"),
])
def test_broken_model_json_files(model, text_file, tmp_path, capsys, name, text, problem):
    _json_file(model / name, text)
    line = _train(model, text_file, tmp_path, capsys)
    assert f"{model / name}" in line and problem in line


def test_config_value_of_the_wrong_type_names_the_file(model, text_file, tmp_path, capsys):
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = "two"
    (model / "config.json").write_text(json.dumps(config))
    line = _train(model, text_file, tmp_path, capsys)
    assert f"{model / 'config.json'}" in line and "num_hidden_layers must be a non-negative integer, got 'two'" in line


def test_truncated_tokenizer_json(model, text_file, tmp_path, capsys):
    data = (model / "tokenizer.json").read_bytes()
    (model / "tokenizer.json").write_bytes(data[: len(data) // 2])
    line = _train(model, text_file, tmp_path, capsys)
    assert f"{model / 'tokenizer.json'}" in line and "is not a readable tokenizer.json (EOF while parsing" in line
    assert "line" in line and "truncated" in line


def test_generation_config(model, tmp_path, capsys):
    _json_file(model / "generation_config.json", '{"eos_token_id": ')
    line = _generate(model, tmp_path, capsys)
    assert f"{model / 'generation_config.json'}" in line
    assert "not valid JSON: Expecting value at line 1 column 18" in line


def test_chat_template_that_does_not_compile(model, tmp_path, capsys):
    (model / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    data = _json_file(tmp_path / "chat.jsonl", json.dumps(CHAT_ROW) + "\n")
    line = _train(model, data, tmp_path, capsys)
    assert "chat template (chat_template.jinja) does not compile: line 2: unexpected '}'" in line


def test_chat_template_that_is_not_utf8(model, text_file, tmp_path, capsys):
    (model / "chat_template.jinja").write_bytes("{{ 'é' }}\n{{ 'ü' }}".encode("latin-1"))
    line = _train(model, text_file, tmp_path, capsys)
    assert f"{model / 'chat_template.jinja'} is not UTF-8 text (line 1, byte offset 4: invalid" in line


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_safetensors_header(model, tmp_path, capsys, damage):
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"{garbage" + data[16:] if damage == "header" else data[:1000])
    line = _generate(model, tmp_path, capsys)
    assert str(weights) in line and "is not a readable safetensors file" in line


def test_safetensors_index(model, tmp_path, capsys):
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    _json_file(model / "model.safetensors.index.json", '{"weight_map": ')
    line = _generate(model, tmp_path, capsys)
    assert f"{model / 'model.safetensors.index.json'}" in line and "not valid JSON: Expecting value at line 1" in line


def test_text_data_that_is_not_utf8(model, tmp_path, capsys):
    data = tmp_path / "latin.txt"
    data.write_bytes("To be, or not to be\nthat is the question: Roméo".encode("latin-1"))
    line = _train(model, data, tmp_path, capsys)
    assert f"{data} is not UTF-8 text (line 2, byte offset 45: invalid continuation byte); convert it to UTF-8" in line


def test_jsonl_data_that_is_not_utf8(model, tmp_path, capsys):
    data = tmp_path / "latin.jsonl"
    data.write_bytes((json.dumps({"text": "ok"}) + "\n" + '{"text": "Roméo"}\n').encode("latin-1"))
    line = _train(model, data, tmp_path, capsys)
    assert f"{data} is not UTF-8 text (line 2, byte offset 28" in line


@pytest.mark.parametrize("row, problem", [
    ('{"text": "an unterminated\tstring', "invalid JSON (Invalid control character at column 26)"),
    ('{"text": "ok"', "invalid JSON (Expecting ',' delimiter at the end of the line: the row is cut short)"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}), "no assistant turn"),
    (json.dumps({"prompt": "y" * 5000}), 'expected {"text": ...} or {"messages": [...]}, got {\'prompt\': \'yyy'),
    (json.dumps({"messages": [{"role": "user", "text": "z" * 5000}]}), "message 0 needs string 'role' and 'content'"),
])
def test_jsonl_rows_are_named_with_their_line(model, tmp_path, capsys, row, problem):
    data = _json_file(tmp_path / "rows.jsonl", json.dumps({"text": "fine"}) + "\n\n" + row + "\n")
    line = _train(model, data, tmp_path, capsys)
    assert f"{data}:3: " in line and problem in line
    assert len(line) - len(str(data)) < 250  # a long row is quoted cut short, not whole (the path's length aside)


def test_heads_config(model, heads_dir, tmp_path, capsys):
    _json_file(heads_dir / "config.json", '{"medusa_num_heads": 2,')
    line = _generate(model, tmp_path, capsys, "--medusa", str(heads_dir))
    assert f"{heads_dir / 'config.json'}" in line and "not valid JSON" in line and "line 1 column 24" in line
    _json_file(heads_dir / "config.json", "[]")
    line = _generate(model, tmp_path, capsys, "--medusa", str(heads_dir))
    assert f"{heads_dir / 'config.json'}" in line and "not a JSON object" in line


def test_heads_file(model, heads_dir, tmp_path, capsys):
    heads = heads_dir / "medusa_lm_head.safetensors"
    heads.write_bytes(heads.read_bytes()[:500])
    line = _generate(model, tmp_path, capsys, "--medusa", str(heads_dir))
    assert f"{heads} is not a readable heads file (500 bytes; truncated or damaged?)" in line


def test_medusa_choices(model, heads_dir, tmp_path, capsys):
    _json_file(heads_dir / "medusa_choices.json", '{"medusa_choices": [[0], [1]')
    line = _generate(model, tmp_path, capsys, "--medusa", str(heads_dir))
    assert f"{heads_dir / 'medusa_choices.json'} is not JSON" in line and "line 1 column 29" in line


def test_prompt_file(model, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes("First line\nRoméo".encode("latin-1"))
    line = _generate(model, tmp_path, capsys, "--prompt-file", str(prompt))
    assert f"--prompt-file {prompt} is not UTF-8 text (line 2, byte offset 14" in line


def test_native_params(tmp_path, capsys):
    src = tmp_path / "native"
    src.mkdir()
    _json_file(src / "params.json", '{"dim": 4096,\n "n_layers": }')
    line = _fails(["convert-native", str(src), str(tmp_path / "out")], capsys)
    assert f"{src / 'params.json'}" in line and "not valid JSON: Expecting value at line 2 column 14" in line


def test_a_training_runs_directories_where_a_checkpoint_is_wanted_name_its_newest(model, tmp_path, capsys):
    """A run's output directory, its checkpoints root or the `latest` pointer file in it, given where a checkpoint
    is wanted (--model, --adapter, --medusa), is refused with the path of the newest checkpoint, and that path
    works; that LoRA checkpoint, given where a whole model is wanted, is refused with what to do instead."""
    from tests.helpers import shakespeare

    data = _json_file(tmp_path / "data.txt", shakespeare(3_000))
    run = tmp_path / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--output-dir", str(run), "--seq-len", "32",
                 "--batch-size", "2", "--max-steps", "2", "--save-every", "1", "--quiet", "--no-data-cache",
                 "--device", "cpu", "--lora-r", "4"]) == 0
    capsys.readouterr()
    newest = run / "checkpoints" / "step_000002"
    named = f"the newest is '{newest}': pass that"
    for wrong in (run, run / "checkpoints"):
        assert _generate(wrong, tmp_path, capsys).endswith(f"no config.json in '{wrong}'; it holds a training run's "
                                                           f"checkpoints, {named}")
        assert named in _generate(model, tmp_path, capsys, "--adapter", str(wrong))
        assert named in _generate(model, tmp_path, capsys, "--medusa", str(wrong))
        assert named in _fails(["merge-lora", "--adapter", str(wrong), "--out", str(tmp_path / "merged")], capsys)
    pointer = run / "checkpoints" / "latest"
    assert _generate(pointer, tmp_path, capsys).endswith(
        f"'{pointer}' is a file; it is a training run's pointer to its newest checkpoint, {named}")
    assert named in _generate(model, tmp_path, capsys, "--adapter", str(pointer))
    assert main(["generate", "--model", str(newest), "--prompt", "ROMEO:", "--max-new-tokens", "2", "--device",
                 "cpu"]) == 0
    # The LoRA checkpoint itself where a whole model is wanted: what to do with an adapter instead.
    capsys.readouterr()
    assert _train(newest, data, tmp_path, capsys).endswith(
        f"no config.json in '{newest}': it holds a LoRA adapter (adapter_config.json), not a model. Decode with it "
        f"through `liger-models generate --model {newest}`, or merge it into its base with `liger-models merge-lora "
        f"--adapter {newest} --out DIR` and pass DIR (from Python: load the base, then liger_models.lora.load_adapter)")
