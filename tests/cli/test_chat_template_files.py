"""Checkpoints keep every tokenizer file of the model they were trained from, chat templates included, wherever the
model keeps its template (chat_template.jinja and additional_chat_templates/ as transformers v5 saves them, a string
or a list of named templates in tokenizer_config.json, an older processor's chat_template.json). So training further,
``generate --chat`` and ``chat`` on a trained checkpoint render conversations as the model did (the text
transformers' apply_chat_template renders from the same files), not with the built-in template; and train,
train-medusa and chat log which template they use."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from liger_models.hub import load_tokenizer  # the fast tokenizer itself
from liger_models.recipes.chat import run_chat
from liger_models.cli import build_parser, main
from liger_models.recipes.decoding import Decoded, run_generate
from liger_models.hub import ALLOW_PATTERNS, IGNORE_PATTERNS, tokenizer_files
from liger_models.train.data import read_special_tokens, render_generation_prompt

pytestmark = pytest.mark.usefixtures("reference_path")

SMALL = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "1"]
QUESTION = [{"role": "user", "content": "Who art thou?"}]
NAMED = "{% for m in messages %}(tool) {{ m['content'] }}\n{% endfor %}"  # a named template: never the default


def template(tag: str) -> str:
    """A prefix-stable template (training locates assistant turns with it) that says where it was read from."""
    return ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            f"{{% if add_generation_prompt %}}<<assistant, {tag}>> {{% endif %}}")


def _edit_json(path: Path, **fields) -> None:
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **fields}))


def _put_template(model_dir: Path, where: str) -> str:
    """Give the model a template in the place named ``where``; returns the file the commands should name."""
    if where in ("jinja", "jinja + named"):
        (model_dir / "chat_template.jinja").write_text(template(where))
        if where == "jinja + named":
            (model_dir / "additional_chat_templates").mkdir()
            (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text(NAMED)
        return "chat_template.jinja"
    if where == "tokenizer_config":
        _edit_json(model_dir / "tokenizer_config.json", chat_template=template(where))
        return "tokenizer_config.json"
    if where == "tokenizer_config list":
        _edit_json(model_dir / "tokenizer_config.json", chat_template=[
            {"name": "tool_use", "template": NAMED}, {"name": "default", "template": template(where)}])
        return "tokenizer_config.json (its 'default' template)"
    assert where == "chat_template.json"
    _edit_json(model_dir / "chat_template.json", chat_template=template(where))
    return "chat_template.json"


def _hf_render(model_dir: Path, messages: list[dict]) -> str:
    """transformers' rendering of the conversation's generation prompt from the checkpoint's files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    legacy = model_dir / "chat_template.json"
    # A tokenizer does not read chat_template.json (a processor's file): its template is handed over explicitly.
    given = {"chat_template": json.loads(legacy.read_text())["chat_template"]} if legacy.is_file() else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **given)


def _model_with_template(tiny_model_dir: Path, tmp_path: Path, where: str | None) -> tuple[Path, str | None]:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    return model, None if where is None else _put_template(model, where)


def _train(model: Path, data: Path, out: Path, capsys, *command) -> tuple[Path, str]:
    """Run `train` (or the given command) for one step; (its checkpoint, its stdout)."""
    command = command or ("train",)
    assert main([*command, "--model", str(model), "--data", str(data), "--output-dir", str(out), *SMALL]) == 0
    return out / "checkpoints" / "step_000001", capsys.readouterr().out


def _assert_same_tokenizer_files(src: Path, checkpoint: Path) -> None:
    names = tokenizer_files(src)
    assert tokenizer_files(checkpoint) == names
    for name in names:
        assert (checkpoint / name).read_bytes() == (src / name).read_bytes(), name


def _generate_prompt_ids(model: Path, *more) -> list[int]:
    args = build_parser().parse_args(["generate", *more, "--model", str(model), "--chat", "--prompt",
                                      QUESTION[0]["content"], "--max-new-tokens", "2", "--greedy", "--device", "cpu"])
    [result] = run_generate(args, out=io.StringIO(), log=io.StringIO())
    return result.prompt_ids


class Recorder:
    """chat's decoder, replaced: records each conversation's token ids and replies without loading weights."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def warm_up(self, prompts) -> None:
        pass

    def __call__(self, ids: list[int]) -> Decoded:
        self.prompts.append(ids)
        return Decoded("Well met.", [7], 1.0)


def _chat(model: Path, lines: list[str], monkeypatch) -> tuple[list[list[int]], str]:
    """(the token ids chat decoded for each turn, its log)."""
    recorder = Recorder()
    monkeypatch.setattr("liger_models.recipes.chat.open_decoder", lambda *args: recorder)
    log = io.StringIO()
    args = build_parser().parse_args(["chat", "--model", str(model), "--device", "cpu"])
    run_chat(args, stdin=io.StringIO("".join(line + "\n" for line in lines)), out=io.StringIO(), log=log)
    return recorder.prompts, log.getvalue()


@pytest.mark.parametrize("where", ["jinja", "jinja + named", "tokenizer_config", "tokenizer_config list",
                                   "chat_template.json"])
def test_train_keeps_the_template_and_everything_renders_with_it(where, tiny_model_dir, text_file, tmp_path,
                                                                 capsys, monkeypatch):
    model, source = _model_with_template(tiny_model_dir, tmp_path, where)
    note = f"[chat template] the model's own, from {source}"
    checkpoint, out = _train(model, text_file, tmp_path / "first", capsys)
    assert note in out  # logged once, at the start
    assert out.count("[chat template]") == 1
    _assert_same_tokenizer_files(model, checkpoint)
    # Training further from the trained checkpoint still finds the model's template there.
    again, out = _train(checkpoint, text_file, tmp_path / "again", capsys)
    assert note in out
    _assert_same_tokenizer_files(model, again)

    tokenizer = load_tokenizer(again)
    expected = _hf_render(again, QUESTION)
    assert expected == _hf_render(model, QUESTION)  # what transformers renders for the model it was trained from
    assert render_generation_prompt(QUESTION, read_special_tokens(tokenizer, again)).text == expected
    assert _generate_prompt_ids(again) == tokenizer.encode(expected, add_special_tokens=False).ids

    prompts, log = _chat(again, [QUESTION[0]["content"], "Speak on."], monkeypatch)
    assert log.count(note) == 1
    conversation = QUESTION + [{"role": "assistant", "content": "Well met."}, {"role": "user", "content": "Speak on."}]
    assert prompts == [tokenizer.encode(_hf_render(again, turns), add_special_tokens=False).ids
                       for turns in (QUESTION, conversation)]


def test_a_model_without_a_template_says_it_uses_the_built_in_one(tiny_model_dir, text_file, tmp_path, capsys,
                                                                  monkeypatch):
    checkpoint, out = _train(tiny_model_dir, text_file, tmp_path / "run", capsys)
    assert "[chat template] the built-in simple one (the model has none: no chat_template.jinja, " in out
    assert not any("chat_template" in name for name in tokenizer_files(checkpoint))
    simple = "<|user|>\nWho art thou?\n<|assistant|>\n"
    assert _generate_prompt_ids(checkpoint) == load_tokenizer(checkpoint).encode(simple).ids
    _, log = _chat(checkpoint, [], monkeypatch)
    assert "[chat template] the built-in simple one" in log


def test_chat_template_simple_is_said_to_set_the_models_own_aside(tiny_model_dir, text_file, tmp_path, capsys):
    model, _ = _model_with_template(tiny_model_dir, tmp_path, "jinja")
    _, out = _train(model, text_file, tmp_path / "run", capsys, "train", "--chat-template", "simple")
    assert ("[chat template] the built-in simple one (--chat-template simple; the model's own, in "
            "chat_template.jinja, is not used)") in out


def test_train_medusa_keeps_the_template(tiny_model_dir, text_file, tmp_path, capsys):
    model, source = _model_with_template(tiny_model_dir, tmp_path, "jinja + named")
    heads, out = _train(model, text_file, tmp_path / "stage1", capsys, "train-medusa", "--num-heads", "2")
    assert f"[chat template] the model's own, from {source}" in out
    _assert_same_tokenizer_files(model, heads)  # beside the heads, for a base found elsewhere
    stage2, out = _train(model, text_file, tmp_path / "stage2", capsys, "train-medusa", "--num-heads", "2",
                         "--stage", "2")
    assert f"[chat template] the model's own, from {source}" in out
    _assert_same_tokenizer_files(model, stage2)
    expected = _hf_render(stage2, QUESTION)
    assert expected == _hf_render(model, QUESTION)
    ids = load_tokenizer(stage2).encode(expected, add_special_tokens=False).ids
    assert _generate_prompt_ids(stage2) == ids  # the stage-2 directory as a plain model
    assert _generate_prompt_ids(stage2, "--medusa", str(stage2)) == ids  # and with its heads


def test_every_tokenizer_file_is_kept_and_nothing_else(tiny_model_dir, text_file, tmp_path, capsys):
    model, _ = _model_with_template(tiny_model_dir, tmp_path, "jinja + named")
    kept = {"tokenizer.model": b"\x00sentencepiece", "tokenizer.model.v3": b"\x01", "spiece.model": b"\x02",
            "vocab.json": b"{}", "merges.txt": b"#version: 0.2\n", "vocab.txt": b"[PAD]\n",
            "added_tokens.json": b"{}", "special_tokens_map.json": b'{"eos_token": "<|endoftext|>"}',
            "chat_template.json": b'{"chat_template": "unused: the .jinja file wins"}', "cl100k.tiktoken": b"IQ== 0\n"}
    dropped = {"README.md": b"# a model", "notes.txt": b"not the tokenizer", "original/tokenizer.model": b"\x03"}
    for name, data in {**kept, **dropped}.items():
        (model / name).parent.mkdir(exist_ok=True)
        (model / name).write_bytes(data)
    checkpoint, _ = _train(model, text_file, tmp_path / "run", capsys)
    _assert_same_tokenizer_files(model, checkpoint)
    assert set(kept) | {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                        "additional_chat_templates/tool_use.jinja"} == set(tokenizer_files(checkpoint))
    assert not any((checkpoint / name).exists() for name in dropped)


def test_hub_downloads_fetch_what_checkpoints_keep():
    # One rule (hub.TOKENIZER_PATTERNS) for both: a downloaded model's tokenizer files are all there to be kept.
    from huggingface_hub.utils import filter_repo_objects

    tokenizer = ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                 "chat_template.jinja", "chat_template.json", "additional_chat_templates/tool_use.jinja",
                 "vocab.json", "merges.txt", "spiece.model", "cl100k.tiktoken"]
    repo = tokenizer + ["config.json", "model.safetensors", "README.md", "original/tokenizer.model"]
    fetched = set(filter_repo_objects(repo, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    assert fetched == set(tokenizer) | {"config.json", "model.safetensors"}
