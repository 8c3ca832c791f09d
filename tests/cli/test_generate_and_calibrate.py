"""`liger-models generate`: prompts encoded as training encodes them, plain and Medusa decoding equal to the library
calls they stand for, the base found from the heads alone, and its errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.hub import load_tokenizer  # the fast tokenizer itself
from liger_models.cli import main
from liger_models.medusa import MedusaModel
from liger_models.medusa.decoding import medusa_generate
from liger_models.train.data import read_special_tokens

pytestmark = pytest.mark.usefixtures("reference_path")


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
    from liger_models.recipes.decoding import run_generate
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


@pytest.mark.parametrize("medusa", [False, True])
def test_a_batch_of_prompts_decodes_each_as_alone(tiny_model_dir, heads_dir, capsys, medusa):
    # Three prompts of different lengths, two per call (left-padded): each continuation is the one it gets alone
    # (with the EOS that may end one row early, and the fill after it cut), one timing line per batch.
    from liger_models.cli import build_parser
    from liger_models.recipes.decoding import run_generate

    prompts = ["ROMEO:", "To be, or not to be, that is", "O"]
    which = ["--medusa", str(heads_dir), "--compare"] if medusa else ["--model", str(tiny_model_dir), "--greedy"]
    argv = ["generate", "--device", "cpu", *which, "--max-new-tokens", "14", "--batch-size", "2"]
    results = run_generate(build_parser().parse_args(argv + [a for p in prompts for a in ("--prompt", p)]))
    for prompt, result in zip(prompts, results):
        assert result.decoded.new_ids == _greedy_reference(tiny_model_dir, prompt, 14)[0]
        assert result.plain is None or result.plain.new_ids == result.decoded.new_ids
    assert results[0].decoded.seconds == results[1].decoded.seconds != results[2].decoded.seconds
    captured = capsys.readouterr()
    assert captured.out == "".join(r.decoded.text + "\n" for r in results)
    kind = "[medusa]" if medusa else "[plain]"
    assert captured.err.count(f"{kind} 2 prompts of ") == 1 and captured.err.count(f"{kind} 1-token prompt") == 1
    if medusa:
        assert "same batch" in captured.err and captured.err.count("identical tokens: True") == 2


@pytest.mark.parametrize("compare", [False, True])
def test_warm_up_before_each_new_prompt_shape_when_comparing(tiny_model_dir, heads_dir, capsys, monkeypatch,
                                                            compare):
    # Kernels compile per shape class on the GPU: with --compare both decoders first decode each new (batch,
    # length) untimed and whole, so Medusa's time never holds compilation that plain decoding then skips; without
    # it one short warm-up at the start.
    from liger_models.cli import build_parser
    from liger_models.recipes.decoding import Decoder, run_generate

    calls = []
    monkeypatch.setattr(Decoder, "warm_up", lambda self, prompts, compare=False, whole=False: calls.append(
        (len(prompts), max(map(len, prompts)), compare, whole)))
    prompts = ["ROMEO:", "To be, or not to be", "ROMEO:", "KING:"]
    argv = ["generate", "--device", "cpu", "--medusa", str(heads_dir), "--max-new-tokens", "3"]
    run_generate(build_parser().parse_args(argv + (["--compare"] if compare else [])
                                           + [a for p in prompts for a in ("--prompt", p)]))
    lengths = [len(load_tokenizer(tiny_model_dir).encode(p).ids) for p in prompts]
    if compare:
        shapes = list(dict.fromkeys(lengths))  # each new length once, in order
        assert calls == [(1, n, True, True) for n in shapes]
    else:
        assert calls == [(1, lengths[0], False, False)]
    capsys.readouterr()


def test_medusa_sampling_is_seeded_and_typical(tiny_model_dir, heads_dir, capsys):
    from liger_models.recipes.decoding import run_generate
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
    from liger_models.recipes.decoding import encode_prompt

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
    (["--greedy", "--top-k", "5"], "contradict"),
    (["--system", "Be brief."], "add --chat"),
    (["--chat-template", "simple"], "add --chat"),
    (["--default-tree"], "give --medusa"),
    (["--tree-tokens", "32"], "give --medusa"),
    (["--medusa", "{heads}", "--top-k", "5"], "plain decoding only"),
    (["--prompt-file", "{tmp}/missing.txt"], "--prompt-file"),
])
def test_bad_arguments_fail_clearly(argv, message, tiny_model_dir, heads_dir, tmp_path, capsys):
    fill = {"model": tiny_model_dir, "tmp": tmp_path, "heads": heads_dir}
    argv = [a.format(**fill) for a in argv]
    prompt = [] if message == "at least one --prompt" else ["--prompt", "x"]
    code, out, err = _generate(["--model", str(tiny_model_dir), *prompt, *argv], capsys)
    assert code == 2 and err.startswith("liger-models: error: ") and message.format(**fill) in err and out == ""


def _trees_used(monkeypatch) -> list:
    """Record the tree every Medusa decoding call verifies (MedusaModel.generate → medusa_generate)."""
    import liger_models.medusa.model as model_module

    seen, real = [], model_module.medusa_generate
    monkeypatch.setattr(model_module, "medusa_generate",
                        lambda *a, **k: seen.append(k["medusa_choices"]) or real(*a, **k))
    return seen


def test_a_batch_verifies_its_tree_cut_to_the_token_budget(tiny_model_dir, heads_dir, capsys, monkeypatch):
    # The demo-sized heads (2) have a 12-choice default tree: 13 tokens a row. Three rows under --tree-tokens 20 cut
    # it to 20 // 3 - 1 = 5 choices, which the log reports and medusa_generate receives; output stays greedy's.
    from liger_models.cli import build_parser
    from liger_models.medusa import decoding
    from liger_models.medusa.tree import TREE_TOKENS, default_medusa_choices, tree_for_batch

    verified, real = [], decoding.generate_medusa_buffers
    monkeypatch.setattr(decoding, "generate_medusa_buffers", lambda c, *a: verified.append(list(c)) or real(c, *a))
    prompts = ["ROMEO:", "To be, or not to be", "O"]
    argv = ["--medusa", str(heads_dir), "--max-new-tokens", "10", "--batch-size", "3", "--tree-tokens", "20"]
    code, out, err = _generate(argv + [a for p in prompts for a in ("--prompt", p)], capsys)
    expected = [_greedy_reference(tiny_model_dir, p, 10)[1] for p in prompts]
    assert code == 0 and out == "".join(text + "\n" for text in expected)
    assert "13-node default tree; 6 nodes per row in batches of 3 (--tree-tokens)" in err
    assert verified[-1] == tree_for_batch(default_medusa_choices(2), 3, 20) and len(verified[-1]) == 5
    # The option's documented default is the library's.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert f"(default {TREE_TOKENS}, measured" in " ".join(capsys.readouterr().out.split())


def test_calibrate_tree_then_generate_uses_it(tiny_model_dir, heads_dir, text_file, capsys, monkeypatch):
    from liger_models.medusa.calibrate import CHOICES_NAME
    from liger_models.medusa.tree import default_medusa_choices

    fit = ["calibrate-tree", "--device", "cpu", "--medusa", str(heads_dir), "--data", str(text_file), "--prompts", "3",
           "--new-tokens", "24"]
    assert main([*fit, "--size", "1"]) == 0
    (single,) = json.loads((heads_dir / CHOICES_NAME).read_text())["medusa_choices"]
    assert len(single) == 1 and 0 <= single[0] < 10  # --size 1: one choice at depth 1
    assert main([*fit, "--size", "5"]) == 0
    err = capsys.readouterr().err
    saved = json.loads((heads_dir / CHOICES_NAME).read_text())
    tree = [tuple(c) for c in saved["medusa_choices"]]
    assert saved["positions"] > 0 and "tokens per base-model forward when decoding them" in err
    assert not saved["kept_default"]  # the default (12 choices) does not fit in 5
    assert 1 <= len(tree) <= 5 and f"a {len(tree) + 1}-node tree" in err
    # What each row gets from the tree as a batch cuts it: the whole tree up to 16 rows (6 × 16 = 96 tokens), and
    # a subtree never accepts more.
    by_batch = saved["by_batch"]
    assert list(by_batch) == ["1", "2", "4", "8", "16"] and "batched (the tree cut to 96 tokens per call)" in err
    assert by_batch["1"]["tokens_per_step"] == saved["tokens_per_step"]
    assert all(row["nodes"] == len(tree) + 1 for row in by_batch.values())
    seen = _trees_used(monkeypatch)
    code, out, err = _generate(["--medusa", str(heads_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                                "--compare"], capsys)
    assert code == 0 and f"{len(tree) + 1}-node calibrated tree" in err and seen == [tree]
    assert "identical tokens: True" in err  # greedy Medusa with any tree is greedy decoding (fp32 here)
    code, out, err = _generate(["--medusa", str(heads_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8",
                                "--default-tree"], capsys)
    assert code == 0 and "13-node default tree" in err and seen[-1] == default_medusa_choices(2)
    # A broken tree file: refused by name when it would be used; --default-tree and calibrate-tree never read it.
    (heads_dir / CHOICES_NAME).write_text('{"medusa_choices": [[0, 0, 0]]}')
    code, out, err = _generate(["--medusa", str(heads_dir), "--prompt", "x", "--max-new-tokens", "2"], capsys)
    assert code == 2 and CHOICES_NAME in err and "does not fit these heads" in err
    code, out, err = _generate(["--medusa", str(heads_dir), "--prompt", "x", "--max-new-tokens", "2",
                                "--default-tree"], capsys)
    assert code == 0
    assert main([*fit, "--size", "3"]) == 0 and len(json.loads((heads_dir / CHOICES_NAME).read_text())
                                                     ["medusa_choices"]) <= 3


def test_paths_given_with_a_tilde_or_relative_to_the_heads(tiny_model_dir, heads_dir, text_file, tmp_path, capsys,
                                                            monkeypatch):
    from liger_models.medusa.calibrate import CHOICES_NAME

    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is the heads' parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["calibrate-tree", "--device", "cpu", "--medusa=~/heads", "--data", str(text_file), "--prompts", "2",
                 "--new-tokens", "16"]) == 0
    assert (heads_dir / CHOICES_NAME).is_file() and not (elsewhere / "~").exists()
    # The heads' config naming its base relative to the heads directory (a run directory moved as a whole).
    moved = tmp_path / "run"
    shutil.copytree(tiny_model_dir, moved / "base")
    shutil.copytree(heads_dir, moved / "heads")
    config = json.loads((moved / "heads" / "config.json").read_text())
    config["base_model_name_or_path"] = "../base"
    (moved / "heads" / "config.json").write_text(json.dumps(config))
    code, out, err = _generate(["--medusa", str(moved / "heads"), "--prompt", "x", "--max-new-tokens", "3"], capsys)
    assert code == 0 and "[medusa]" in err
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "heads" / "config.json").write_text(json.dumps(config))
    code, out, err = _generate(["--medusa", str(moved / "heads"), "--prompt", "x"], capsys)
    assert code == 2 and "its config.json names the base" in err and "pass --model" in err


def test_mistakes_are_caught_before_any_weights_load(tiny_model_dir, heads_dir, text_file, tmp_path, capsys,
                                                     monkeypatch):
    from liger_models import AutoLigerForCausalLM

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the mistake was found")

    monkeypatch.setattr(AutoLigerForCausalLM, "from_pretrained", no_loading)
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "tokenizer.json").unlink()
    code, out, err = _generate(["--model", str(bare), "--prompt", "x"], capsys)
    assert code == 2 and f"no tokenizer.json in {bare}" in err
    code, out, err = _generate(["--model", str(tiny_model_dir), "--chat", "--chat-template", "model", "--prompt", "x"],
                               capsys)
    assert code == 2 and "has no chat_template" in err
    code = main(["calibrate-tree", "--device", "cpu", "--medusa", str(heads_dir), "--data", str(text_file),
                 "--prompt-tokens", "100000"])
    assert code == 2 and "no prompt of 100000 tokens" in capsys.readouterr().err


def test_prompt_files_read_as_training_reads_text(tiny_model_dir, tmp_path, capsys):
    with_bom = tmp_path / "bom.txt"
    with_bom.write_text("ROMEO:", encoding="utf-8-sig")
    code, out, err = _generate(["--model", str(tiny_model_dir), "--prompt-file", str(with_bom), "--max-new-tokens",
                                "4", "--greedy"], capsys)
    assert code == 0 and out == _greedy_reference(tiny_model_dir, "ROMEO:", 4)[1] + "\n"  # the mark is not text
    latin = tmp_path / "latin.txt"
    latin.write_bytes("Roméo".encode("latin-1"))
    code, out, err = _generate(["--model", str(tiny_model_dir), "--prompt-file", str(latin)], capsys)
    assert code == 2 and f"--prompt-file {latin} is not UTF-8 text" in err


def test_sampling_options_mean_sampling():
    from liger_models.cli import build_parser
    from liger_models.recipes import GenerateConfig

    def settings(*argv, medusa=False):
        config = GenerateConfig.from_args(build_parser().parse_args(["generate", "--model", "m", *argv]))
        return config.sampling_settings(medusa)

    assert settings() == ({}, {})  # the checkpoint's generation_config.json decides
    assert settings("--top-k", "3") == ({"top_k": 3, "do_sample": True}, {})
    assert settings("--top-p", "0.9", "--temperature", "0.7") == (
        {"temperature": 0.7, "top_p": 0.9, "do_sample": True}, {})
    assert settings("--greedy") == ({"do_sample": False}, {})
    assert settings(medusa=True) == ({"temperature": 0.0}, {"do_sample": False})
    assert settings("--temperature", "0.5", medusa=True) == (
        {"temperature": 0.5}, {"do_sample": True, "temperature": 0.5, "top_k": 0, "top_p": 1.0})


def test_calibration_prompts_from_text_and_chat(tiny_model_dir, tmp_path):
    from liger_models.recipes.decoding import calibration_prompts
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


def test_a_gated_repo_is_one_line(capsys, monkeypatch):
    # hub.snapshot turns a gated repo (or refused credentials) into a PermissionError that says what to do.
    def gated(model, medusa, adapter=None):
        raise PermissionError("Hub repo 'org/model' is gated: accept its terms at https://huggingface.co/org/model")

    monkeypatch.setattr("liger_models.recipes.decoding.locate", gated)
    code, out, err = _generate(["--model", "org/model", "--prompt", "x"], capsys)
    assert code == 2 and err == ("liger-models: error: Hub repo 'org/model' is gated: accept its terms at "
                                 "https://huggingface.co/org/model\n")


def test_a_mask_only_for_a_prompt_that_holds_the_pad_id(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # A mask sends plain decoding down its padded path; --compare would then time it against unmasked Medusa.
    from liger_models.modules.causal_lm import LigerForCausalLM

    masks, real = [], LigerForCausalLM.generate
    monkeypatch.setattr(LigerForCausalLM, "generate",
                        lambda self, *a, **k: masks.append(k.get("attention_mask")) or real(self, *a, **k))
    padded = tmp_path / "padded"
    shutil.copytree(tiny_model_dir, padded)
    config = json.loads((padded / "config.json").read_text())
    config["pad_token_id"] = load_tokenizer(padded).encode("ROMEO: what").ids[1]
    (padded / "config.json").write_text(json.dumps(config))
    assert _generate(["--model", str(padded), "--prompt", "ROMEO: what", "--prompt", "Hark", "--max-new-tokens", "2",
                      "--greedy"], capsys)[0] == 0
    assert masks[0] is not None and bool(masks[0].all()) and masks[1] is None


def test_processor_options_reach_generate(tiny_model_dir, capsys):
    """--repetition-penalty / --no-repeat-ngram-size / --min-new-tokens / --stop: the command prints what generate
    returns with the same settings (and the text ends at the first stop string)."""
    base = AutoLigerForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = torch.tensor([tokenizer.encode("ROMEO:").ids])
    # A penalty below 1 rewards the prompt's and the output's tokens: a random model's text changes for sure.
    settings = dict(repetition_penalty=0.2, no_repeat_ngram_size=3, min_new_tokens=5)
    new = base.generate(ids, 16, do_sample=False, **settings)[0, ids.shape[1]:].tolist()
    expected = tokenizer.decode(new, skip_special_tokens=True)
    assert expected != _greedy_reference(tiny_model_dir, "ROMEO:", 16)[1]  # the settings change the text
    args = ["--model", str(tiny_model_dir), "--prompt", "ROMEO:", "--max-new-tokens", "16", "--greedy",
            "--repetition-penalty", "0.2", "--no-repeat-ngram-size", "3", "--min-new-tokens", "5"]
    code, out, _ = _generate(args, capsys)
    assert code == 0 and out == expected + "\n"
    # The printed text ends where the stop string first ends after the prompt (it may start in the prompt, and the
    # token completing it may run on past it: test_generate_settings checks that cut).
    stop = expected.strip()[:3]
    code, out, _ = _generate(args + ["--stop", stop], capsys)
    text = out.rstrip("\n")
    whole = "ROMEO:" + text
    assert code == 0 and whole.endswith(stop) and expected.startswith(text)
    assert whole.find(stop, max(0, len("ROMEO:") - len(stop) + 1)) == len(whole) - len(stop)
