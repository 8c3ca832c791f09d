"""`liger-models train --lora-r …` (and --qlora) saves adapters only and resumes bit for bit; `merge-lora` writes a
merged HF checkpoint that transformers loads with the adapted model's logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.cli import main
from liger_models.lora import load_adapter, quantize_base_
from liger_models.train import checkpointing as ckpt

from ..models.parity import float64_reference
from .common import assert_as_close_as_fp32_allows, ulp_moved_logits

pytest.importorskip("peft")
RUN = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "4", "--save-every", "2", "--keep-last", "3",
       "--lr", "1e-2", "--warmup-steps", "1", "--device", "cpu", "--dtype", "fp32", "--quiet",
       "--lora-r", "4", "--lora-alpha", "8", "--lora-dropout", "0.1"]


pytestmark = pytest.mark.usefixtures("reference_kernels")


@pytest.mark.parametrize("kind", ["lora", "qlora", "modules_to_save", "dora", "tables", "layers", "token_rows"])
def test_train_saves_adapters_only_and_resumes_bit_for_bit(base_and_data, tmp_path, kind):
    base, data = base_and_data
    extra = {"lora": [], "qlora": ["--qlora"], "layers": ["--lora-layers", "1"],
             "token_rows": ["--lora-token-rows", "40-47,60"],
             "modules_to_save": ["--lora-modules-to-save", "embed_tokens,lm_head"],
             "dora": ["--lora-dora", "--lora-targets", "q_proj,v_proj,lm_head"],  # with RUN's dropout: composed
             "tables": ["--lora-targets", "q_proj,embed_tokens,lm_head"]}[kind]
    out = tmp_path / "run"
    assert main(["train", "--model", str(base), "--data", str(data), "--output-dir", str(out), *RUN, *extra]) == 0
    last = out / "checkpoints" / ckpt.step_dir_name(4)
    files = {p.name for p in last.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files), files
    model = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    load_adapter(model, last)  # a PEFT adapter of the base
    if kind == "dora":
        assert json.loads((last / "adapter_config.json").read_text())["use_dora"] is True
        assert model.model.layers[0].self_attn.q_proj.use_dora and model.lm_head.use_dora
    if kind == "layers":  # PEFT's layers_to_transform: the second layer's linears alone carry adapters
        assert json.loads((last / "adapter_config.json").read_text())["layers_to_transform"] == [1]
        assert model.model.layers[1].self_attn.q_proj.lora_A is not None
        assert not hasattr(model.model.layers[0].self_attn.q_proj, "lora_A")
    if kind == "token_rows":  # PEFT's trainable_token_indices: those rows trained, the table itself did not
        assert json.loads((last / "adapter_config.json").read_text())["trainable_token_indices"] == {
            "embed_tokens": [*range(40, 48), 60]}
        plain = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
        assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)
        rows = model.model.embed_tokens.token_adapter.trainable_tokens_delta
        assert not torch.equal(rows, plain.model.embed_tokens.weight[[*range(40, 48), 60]])
    if kind == "tables":  # the embedding adapter's A starts at zero: it trained
        assert torch.count_nonzero(model.model.embed_tokens.lora_embedding_A) > 0
    if kind == "modules_to_save":  # the whole modules trained and came back with the adapter
        plain = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
        assert not torch.equal(model.lm_head.weight, plain.lm_head.weight)
        assert not torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)

    # Resume from step 2 (step 4 removed): the run ends with the same adapter bytes.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / ckpt.step_dir_name(4))
    assert main(["train", "--model", str(base), "--data", str(data), "--output-dir", str(resumed), *RUN, *extra,
                 "--resume", "auto"]) == 0
    again = resumed / "checkpoints" / ckpt.step_dir_name(4) / "adapter_model.safetensors"
    assert again.read_bytes() == (last / "adapter_model.safetensors").read_bytes()


def test_resume_with_other_lora_settings_is_refused(base_and_data, tmp_path, capsys):
    base, data = base_and_data
    out = tmp_path / "run"
    args = ["train", "--model", str(base), "--data", str(data), "--output-dir", str(out), *RUN]
    assert main([*args, "--max-steps", "2", "--lora-layers", "0-1"]) == 0  # the last of a repeated option counts
    capsys.readouterr()
    for changed in (["--lora-r", "8", "--lora-layers", "0-1"], ["--lora-layers", "1"], [],
                    ["--lora-layers", "0-1", "--lora-token-rows", "5"]):
        assert main([*args, *changed, "--resume", "auto"]) != 0
        err = capsys.readouterr().err
        assert "other settings: lora" in err and "--allow-changed-settings lora" in err
    assert main([*args, "--max-steps", "3", "--lora-layers", "1,0", "--resume", "auto"]) == 0  # the same layers


@pytest.mark.parametrize("option", [["--qlora"], ["--lora-layers", "1"], ["--lora-token-rows", "5"]])
def test_lora_options_need_lora_r(base_and_data, tmp_path, capsys, option):
    base, data = base_and_data
    assert main(["train", "--model", str(base), "--data", str(data), "--output-dir", str(tmp_path / "r"),
                 *option, "--device", "cpu", "--quiet"]) != 0
    assert "give --lora-r too" in capsys.readouterr().err


@pytest.mark.parametrize("layers, message", [("1-0", "'1-0' is not a layer index or a range"),
                                             ("0,2", "names layer 2, but this model has 2 decoder layers")])
def test_lora_layers_the_model_cannot_take_are_refused(base_and_data, tmp_path, capsys, layers, message):
    base, data = base_and_data
    out = tmp_path / "run"
    assert main(["train", "--model", str(base), "--data", str(data), "--output-dir", str(out), *RUN,
                 "--lora-layers", layers]) != 0
    assert message in capsys.readouterr().err
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("kind", ["lora", "qlora_base", "dora", "tables"])
def test_merge_lora_writes_a_checkpoint_transformers_loads(base_and_data, tmp_path, kind):
    base, data = base_and_data
    qlora_base = kind == "qlora_base"
    out = tmp_path / "run"
    run = [*RUN[:RUN.index("--max-steps")], "--max-steps", "2", *RUN[RUN.index("--max-steps") + 2:]]
    run += {"dora": ["--lora-dora", "--lora-targets", "q_proj,v_proj,lm_head"],
            "tables": ["--lora-targets", "q_proj,embed_tokens,lm_head"]}.get(kind, [])
    assert main(["train", "--model", str(base), "--data", str(data), "--output-dir", str(out), *run]) == 0
    adapter = out / "checkpoints" / ckpt.step_dir_name(2)
    merged = tmp_path / "merged"
    argv = ["merge-lora", "--adapter", str(adapter), "--out", str(merged), "--dtype", "fp32"]
    assert main(argv + (["--qlora-base"] if qlora_base else [])) == 0
    model = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    if qlora_base:
        quantize_base_(model)
    load_adapter(model, adapter)
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        exact = float64_reference(hf)(input_ids=ids).logits  # the merged file's weights, in float64
        assert_as_close_as_fp32_allows(model.eval()(ids).logits, hf(input_ids=ids).logits, exact,
                                       redraw=ulp_moved_logits(model, ids))
    assert (merged / "tokenizer.json").is_file()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_lora_trains_the_experts_resumes_and_merges(base_and_data, tmp_path, family, capsys):
    """`train --lora-r` on a mixture-of-experts base: all-linear adapts the routers and expert stacks too (PEFT's
    target_parameters in the adapter), a resume ends with the same bytes, and `merge-lora` writes a checkpoint
    (per-expert names) that transformers loads with the adapted logits. Dropout is refused there, by name."""
    import liger_models
    from liger_models.hub import copy_tokenizer_files

    base, data = base_and_data
    llama = json.loads((base / "config.json").read_text())
    config_cls = {"qwen3_moe": liger_models.Qwen3MoeConfig, "mixtral": liger_models.MixtralConfig}[family]
    config = config_cls.tiny(vocab_size=llama["vocab_size"], bos_token_id=None, eos_token_id=llama["eos_token_id"],
                             pad_token_id=None)
    moe = tmp_path / "moe"
    AutoLigerForCausalLM.from_config(config).save_pretrained(moe)
    copy_tokenizer_files(base, moe)
    run = [*RUN[:RUN.index("--lora-dropout")], "--max-steps", "4"]
    out = tmp_path / "run"
    assert main(["train", "--model", str(moe), "--data", str(data), "--output-dir", str(out), *run]) == 0
    last = out / "checkpoints" / ckpt.step_dir_name(4)
    assert json.loads((last / "adapter_config.json").read_text())["target_parameters"] == [
        "down_proj", "gate.weight", "gate_up_proj"]
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / ckpt.step_dir_name(4))
    assert main(["train", "--model", str(moe), "--data", str(data), "--output-dir", str(resumed), *run,
                 "--resume", "auto"]) == 0
    again = resumed / "checkpoints" / ckpt.step_dir_name(4) / "adapter_model.safetensors"
    assert again.read_bytes() == (last / "adapter_model.safetensors").read_bytes()

    merged = tmp_path / "merged"
    assert main(["merge-lora", "--adapter", str(last), "--out", str(merged), "--dtype", "fp32"]) == 0
    model = AutoLigerForCausalLM.from_pretrained(moe, dtype=torch.float32)
    load_adapter(model, last)
    assert torch.count_nonzero(model.model.layers[0].mlp.experts.lora["down_proj"].lora_B) > 0  # it trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    hf.set_experts_implementation("eager")  # float64 below: HF's grouped_mm has no float64 CPU kernel
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        exact = float64_reference(hf)(input_ids=ids).logits
        assert_as_close_as_fp32_allows(model.eval()(ids).logits, hf(input_ids=ids).logits, exact,
                                       redraw=ulp_moved_logits(model, ids))

    capsys.readouterr()
    refused = ["train", "--model", str(moe), "--data", str(data), "--output-dir", str(tmp_path / "dropout"), *RUN]
    assert main(refused) == 2
    assert "neither dropout nor DoRA" in capsys.readouterr().err


def test_train_on_a_bitsandbytes_4bit_checkpoint_as_it_is(base_and_data, tmp_path, capsys):
    """What QLoRA users download: `train --model <bnb 4-bit checkpoint> --lora-r` trains adapters on its NF4 base
    (loaded as stored: the same codes and scales), equal to `--qlora` on the checkpoint it was quantised from, and
    `merge-lora` merges them into it; without --lora-r it is refused by name."""
    from liger_models.lora import save_bnb_4bit
    from liger_models.hub import copy_tokenizer_files

    base, data = base_and_data
    bnb = tmp_path / "bnb"
    save_bnb_4bit(AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32), bnb)
    copy_tokenizer_files(base, bnb)
    run = [*RUN[:RUN.index("--max-steps")], "--max-steps", "2", *RUN[RUN.index("--max-steps") + 2:]]
    assert main(["train", "--model", str(bnb), "--data", str(data), "--output-dir", str(tmp_path / "a"), *run]) == 0
    assert main(["train", "--model", str(base), "--data", str(data), "--output-dir", str(tmp_path / "b"), *run,
                 "--qlora"]) == 0
    step = ckpt.step_dir_name(2)
    a = (tmp_path / "a" / "checkpoints" / step / "adapter_model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "checkpoints" / step / "adapter_model.safetensors").read_bytes()
    assert main(["merge-lora", "--adapter", str(tmp_path / "a" / "checkpoints" / step), "--model", str(bnb),
                 "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    assert transformers.AutoConfig.from_pretrained(tmp_path / "merged").to_dict().get("quantization_config") is None
    capsys.readouterr()
    assert main(["train", "--model", str(bnb), "--data", str(data), "--output-dir", str(tmp_path / "c"),
                 "--max-steps", "1", "--device", "cpu", "--quiet"]) != 0
    assert "bitsandbytes 4-bit checkpoint" in capsys.readouterr().err
