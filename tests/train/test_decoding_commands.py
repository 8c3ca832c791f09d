"""`liger-models generate`: prompts encoded as training encodes them, plain and Medusa decoding equal to the library
calls they stand for, the base found from the heads alone, and its errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from liger_models import AutoLigerForCausalLM, load_tokenizer
from liger_models.cli import main
from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from liger_models.train.data import read_special_tokens

pytestmark = pytest.mark.usefixtures("reference_path")


@pytest.fixture
def heads_dir(tiny_model_dir, tmp_path):
    """Fresh random heads for the tiny model, saved as train-medusa saves them (the base named in config.json),
    with biases large enough that the heads' guesses differ from the base's."""
    base = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    medusa = MedusaModel.from_base(base, num_heads=2)
    for k in range(2):
        torch.nn.init.normal_(medusa.heads[k][0].linear.bias, std=3.0)
    out = tmp_path / "heads"
    medusa.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config["base_model_name_or_path"] = str(tiny_model_dir)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _generate(argv, capsys) -> tuple[int, str, str]:
    code = main(["generate", "--device", "cpu", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _greedy_reference(model_dir, text: str, n: int) -> tuple[list[int], str]:
    base = AutoLigerForCausalLM.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    ids = torch.tensor([tokenizer.encode(text).ids])
    new = base.generate(ids, n, do_sample=False)[0, ids.shape[1]:].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


def test_plain_greedy_prints_what_generate_returns(tiny_model_dir, capsys):
    code, out, err = _generate(["--model", str(tiny_model_dir), "--prompt", "ROMEO:", "--prompt", "To be",
                                "--max-new-tokens", "9", "--greedy"], capsys)
    assert code == 0
    expected = [_greedy_reference(tiny_model_dir, p, 9)[1] for p in ("ROMEO:", "To be")]
    assert out == "".join(text + "\n" for text in expected)
    assert err.count("[plain]") == 2 and "tokens/s" in err and "base-model forward" not in err


def test_medusa_alone_finds_its_base_and_matches_plain_greedy(tiny_model_dir, heads_dir, capsys):
    from liger_models.decoding_commands import run_generate
    from liger_models.cli import build_parser

    args = build_parser().parse_args(["generate", "--device", "cpu", "--medusa", str(heads_dir), "--prompt",
                                      "ROMEO:", "--max-new-tokens", "12", "--compare"])
    (result,) = run_generate(args)
    expected_ids, expected_text = _greedy_reference(tiny_model_dir, "ROMEO:", 12)
    assert result.decoded.new_ids == expected_ids == result.plain.new_ids  # the EOS may end both early
    assert result.decoded.text == expected_text
    assert result.decoded.tokens_per_step >= 1.0 and result.plain.tokens_per_step is None
    err = capsys.readouterr().err
    assert "[medusa]" in err and "tokens per base-model forward" in err and "identical tokens: True" in err


def test_medusa_sampling_is_seeded_and_typical(tiny_model_dir, heads_dir, capsys):
    from liger_models.decoding_commands import run_generate
    from liger_models.cli import build_parser

    def run(seed: int):
        args = build_parser().parse_args(["generate", "--device", "cpu", "--medusa", str(heads_dir), "--prompt",
                                          "ROMEO:", "--max-new-tokens", "16", "--temperature", "0.9",
                                          "--seed", str(seed)])
        return run_generate(args)[0].decoded.new_ids

    base = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    heads = MedusaModel.from_pretrained(str(heads_dir), base=base).heads
    ids = torch.tensor([load_tokenizer(tiny_model_dir).encode("ROMEO:").ids])
    expected = medusa_generate(base, heads, ids, 16, temperature=0.9, generator=torch.Generator().manual_seed(5))
    assert run(5) == expected[0, ids.shape[1]:].tolist() == run(5)  # the library call with the same seed
    assert len({tuple(run(seed)) for seed in range(6)}) > 1  # the seed matters: the draws are random


def test_chat_prompts_are_rendered_as_training_renders_them(tiny_model_dir, tmp_path, capsys):
    from liger_models.decoding_commands import encode_prompt

    tokenizer = load_tokenizer(tiny_model_dir)
    special = read_special_tokens(tokenizer, tiny_model_dir)
    simple = encode_prompt("Hi there", tokenizer, special, chat=True, system="Be brief.")
    assert simple == tokenizer.encode("<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n").ids
    # With a jinja template in tokenizer_config.json (auto picks it): the template's generation prompt, and the
    # BOS it writes is not added a second time.
    templated = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, templated)
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    config["bos_token"] = "<|endoftext|>"
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    special = read_special_tokens(tokenizer, templated)
    ids = encode_prompt("Hi there", tokenizer, special, chat=True)
    assert ids == tokenizer.encode("<|endoftext|>[user] Hi there\n[assistant] ", add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id("<|endoftext|>") and ids[1] != ids[0]
    code, out, err = _generate(["--model", str(templated), "--chat", "--prompt", "Hi there", "--max-new-tokens",
                                "3", "--greedy"], capsys)
    assert code == 0 and f"{len(ids)}-token prompt" in err


def test_prompt_file_is_one_prompt(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "prompt.txt"
    path.write_text("ROMEO:\nWhat light", encoding="utf-8")
    code, out, err = _generate(["--model", str(tiny_model_dir), "--prompt-file", str(path), "--max-new-tokens", "5",
                                "--greedy"], capsys)
    assert code == 0 and out == _greedy_reference(tiny_model_dir, "ROMEO:\nWhat light", 5)[1] + "\n"


@pytest.mark.parametrize("argv, message", [
    ([], "at least one --prompt"),
    (["--medusa", "{model}"], "--medusa {model}: no Medusa heads"),
    (["--medusa", "{tmp}/nope"], "no such directory"),
    (["--compare"], "give --medusa"),
    (["--greedy", "--temperature", "0.5"], "contradict"),
    (["--medusa", "{heads}", "--top-k", "5"], "plain decoding only"),
    (["--prompt-file", "{tmp}/missing.txt"], "--prompt-file"),
])
def test_bad_arguments_fail_clearly(argv, message, tiny_model_dir, heads_dir, tmp_path, capsys):
    fill = {"model": tiny_model_dir, "tmp": tmp_path, "heads": heads_dir}
    argv = [a.format(**fill) for a in argv]
    prompt = [] if message == "at least one --prompt" else ["--prompt", "x"]
    code, out, err = _generate(["--model", str(tiny_model_dir), *prompt, *argv], capsys)
    assert code == 2 and err.startswith("liger-models: error: ") and message.format(**fill) in err and out == ""


def test_calibrate_tree_then_generate_uses_it(tiny_model_dir, heads_dir, text_file, capsys):
    from liger_models.medusa.calibrate import CHOICES_NAME

    assert main(["calibrate-tree", "--device", "cpu", "--medusa", str(heads_dir), "--data", str(text_file),
                 "--prompts", "3", "--new-tokens", "24", "--size", "7"]) == 0
    err = capsys.readouterr().err
    saved = json.loads((heads_dir / CHOICES_NAME).read_text())
    assert 1 <= len(saved["medusa_choices"]) <= 7 and saved["positions"] > 0
    assert f"{len(saved['medusa_choices']) + 1}-node tree fitted" in err and "tokens per base-model forward" in err
    code, out, err = _generate(["--medusa", str(heads_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                                "--compare"], capsys)
    assert code == 0 and f"{len(saved['medusa_choices']) + 1}-node calibrated tree" in err
    assert "identical tokens: True" in err  # greedy Medusa with any tree is greedy decoding
    code, out, err = _generate(["--medusa", str(heads_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                                "--default-tree"], capsys)
    assert code == 0 and "default tree" in err


def test_calibration_prompts_from_text_and_chat(tiny_model_dir, tmp_path):
    from liger_models.decoding_commands import calibration_prompts
    from liger_models.train.data import load_documents, render_generation_prompt

    tokenizer = load_tokenizer(tiny_model_dir)
    special = read_special_tokens(tokenizer, tiny_model_dir)
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 20, encoding="utf-8")
    ids = tokenizer.encode(text.read_text()).ids
    windows = calibration_prompts([text], tokenizer, special, count=1000, prompt_tokens=16)
    assert windows == [ids[i: i + 16] for i in range(0, len(ids) - 15, 16)]  # every full window, EOS left out
    picked = calibration_prompts([text], tokenizer, special, count=3, prompt_tokens=16)
    assert picked == [windows[0], windows[round((len(windows) - 1) / 2)], windows[-1]]  # evenly spaced
    chat = tmp_path / "c.jsonl"
    turns = [{"role": "user", "content": "Speak."}, {"role": "assistant", "content": "Friends, Romans."}]
    chat.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    (prompt,) = calibration_prompts([chat], tokenizer, special, count=4, prompt_tokens=16)
    # The conversation up to the assistant's first token: the generation prompt training rendered.
    opened = render_generation_prompt(turns[:1], special).text
    assert tokenizer.decode(prompt) == opened and load_documents([chat], special)[0].text.startswith(opened)
    with pytest.raises(ValueError, match="no prompt of 4096 tokens"):
        calibration_prompts([text], tokenizer, special, count=2, prompt_tokens=4096)


def test_vllm_layout_heads_decode_with_their_base(tiny_model_dir, heads_dir, tmp_path, capsys):
    from liger_models.convert.medusa import save_vllm

    medusa = MedusaModel.from_pretrained(str(heads_dir))
    save_vllm(medusa.heads, str(tmp_path / "vllm"))
    code, out, err = _generate(["--medusa", str(tmp_path / "vllm"), "--prompt", "ROMEO:", "--max-new-tokens", "6"],
                               capsys)
    assert code == 0 and "[medusa]" in err  # the export's config names the base
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    del config["base_model_name_or_path"]  # as vLLM's own Medusa configs: no base named
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    code, out, err = _generate(["--medusa", str(tmp_path / "vllm"), "--prompt", "ROMEO:"], capsys)
    assert code == 2 and "no base_model_name_or_path; pass --model" in err
    code, out, err = _generate(["--model", str(tiny_model_dir), "--medusa", str(tmp_path / "vllm"), "--prompt",
                                "ROMEO:", "--max-new-tokens", "6", "--compare"], capsys)
    assert code == 0 and "identical tokens: True" in err
    (tmp_path / "vllm" / "model.safetensors").unlink()
    code, out, err = _generate(["--model", str(tiny_model_dir), "--medusa", str(tmp_path / "vllm"), "--prompt", "x"],
                               capsys)
    assert code == 2 and "missing model.safetensors" in err


def test_a_prompt_holding_the_pad_id_is_text(tiny_model_dir, heads_dir, tmp_path, capsys):
    # With a pad id of its own in config.json, generate would read that id in a prompt as padding (as HF infers it),
    # and Medusa decoding would refuse the prompt; the command's prompts are one unpadded text each.
    padded = tmp_path / "padded"
    shutil.copytree(tiny_model_dir, padded)
    config = json.loads((padded / "config.json").read_text())
    tokenizer = load_tokenizer(padded)
    prompt_ids = tokenizer.encode("ROMEO: what").ids
    config["pad_token_id"] = prompt_ids[1]
    (padded / "config.json").write_text(json.dumps(config))
    code, out, err = _generate(["--model", str(padded), "--medusa", str(heads_dir), "--prompt", "ROMEO: what",
                                "--max-new-tokens", "6", "--compare"], capsys)
    assert code == 0 and "identical tokens: True" in err
    base = AutoLigerForCausalLM.from_pretrained(padded)
    ids = torch.tensor([prompt_ids])
    expected = base.generate(ids, 6, do_sample=False, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert out == tokenizer.decode(expected.tolist(), skip_special_tokens=True) + "\n"
