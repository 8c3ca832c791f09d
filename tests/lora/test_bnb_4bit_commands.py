"""The decoding and Medusa commands on a bitsandbytes 4-bit checkpoint as it is (what QLoRA users download): its NF4
base decodes as the dense model holding the same dequantised weights; Medusa heads train on it in stage 1 (frozen
base) and, through adapters, in stage 2, equal to ``--qlora`` on the checkpoint it was quantised from; the heads
decode on it again. `train` on such a checkpoint: tests/lora/test_cli.py."""

from __future__ import annotations

import io

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.cli import build_parser, main
from liger_models.hub import copy_tokenizer_files
from liger_models.kernels.ops import nf4_matmul
from liger_models.lora import load_bnb_4bit, lora_modules, save_bnb_4bit, save_merged
from liger_models.medusa import MedusaModel
from liger_models.modules.lora_linear import LoraLinear
from liger_models.recipes.decoding import run_generate
from liger_models.train import checkpointing as ckpt

RUN = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "2", "--save-every", "2", "--lr", "1e-2",
       "--warmup-steps", "1", "--device", "cpu", "--dtype", "fp32", "--quiet", "--num-heads", "2"]

pytestmark = pytest.mark.usefixtures("reference_kernels")


@pytest.fixture(scope="module")
def bnb(base_and_data, tmp_path_factory):
    """The tiny base written as transformers + bitsandbytes write a 4-bit model, its tokenizer beside it."""
    base, _ = base_and_data
    path = tmp_path_factory.mktemp("bnb") / "bnb"
    save_bnb_4bit(AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32), path)
    copy_tokenizer_files(base, path)
    return path


def _generate(argv: list[str], device: str = "cpu"):
    """Greedy, 12 new tokens; plain decoding takes --min-new-tokens, so that a random base's EOS (which it emits at
    some seeds, 166752572) does not end the comparison early (Medusa decoding refuses the option)."""
    at_least = [] if "--medusa" in argv else ["--min-new-tokens", "12"]
    return run_generate(build_parser().parse_args(["generate", *argv, "--device", device, "--dtype", "fp32",
                                                   "--greedy", "--max-new-tokens", "12", *at_least,
                                                   "--prompt", "ROMEO:"]),
                        out=io.StringIO(), log=io.StringIO())


def _dequantised(bnb, tmp_path):
    """The dense checkpoint of the NF4 base's dequantised weights (merged with no adapter: W = dequant(codes))."""
    dense = tmp_path / "dequantised"
    save_merged(load_bnb_4bit(bnb, dtype=torch.float32), dense, dtype=torch.float32)
    copy_tokenizer_files(bnb, dense)
    return dense


def test_generate_decodes_on_the_nf4_base_as_the_dequantised_dense_model(bnb, tmp_path):
    [on_nf4] = _generate(["--model", str(bnb)])
    [on_dense] = _generate(["--model", str(_dequantised(bnb, tmp_path))])
    assert len(on_nf4.decoded.new_ids) == 12
    assert on_nf4.decoded.new_ids == on_dense.decoded.new_ids


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 16], ids=["dequantise", "nf4_matmul"])
def test_on_cuda_the_nf4_base_decodes_in_cuda_graphs_as_the_dequantised_dense_model(bnb, tmp_path, rows, tune):
    """The NF4 kernels inside captured decode steps (dequantisation, or nf4_matmul for steps of up to ``rows``
    rows): the same tokens as eager steps and as the dense model."""
    tune(nf4_matmul, max_rows=rows)
    [graphed] = _generate(["--model", str(bnb)], device="cuda")
    [eager] = _generate(["--model", str(bnb), "--no-cuda-graph"], device="cuda")
    [on_dense] = _generate(["--model", str(_dequantised(bnb, tmp_path))], device="cuda")
    assert len(graphed.decoded.new_ids) == 12
    assert graphed.decoded.new_ids == eager.decoded.new_ids == on_dense.decoded.new_ids


def test_medusa_stage1_trains_heads_on_the_nf4_base_and_decodes_with_them(base_and_data, bnb, tmp_path):
    _, data = base_and_data
    out = tmp_path / "stage1"
    assert main(["train-medusa", "--model", str(bnb), "--data", str(data), "--output-dir", str(out), *RUN,
                 "--stage", "1"]) == 0
    heads = out / "checkpoints" / ckpt.step_dir_name(2)
    medusa = MedusaModel.from_pretrained(str(heads), dtype=torch.float32)
    assert medusa.stage == 1
    quantised = [m for m in medusa.base.modules() if isinstance(m, LoraLinear) and m.quant is not None]
    assert quantised and not lora_modules(medusa.base)  # the base named by the heads, loaded as stored: NF4
    [result] = _generate(["--medusa", str(heads), "--compare"])
    assert result.decoded.new_ids == result.plain.new_ids  # tree decoding on the NF4 base is greedy decoding


def test_medusa_stage2_through_adapters_equals_qlora_on_the_unquantised_checkpoint(base_and_data, bnb, tmp_path,
                                                                                  capsys):
    base, data = base_and_data
    stage2 = [*RUN, "--stage", "2", "--lora-r", "4", "--lora-alpha", "8"]
    assert main(["train-medusa", "--model", str(bnb), "--data", str(data), "--output-dir", str(tmp_path / "a"),
                 *stage2]) == 0
    assert main(["train-medusa", "--model", str(base), "--data", str(data), "--output-dir", str(tmp_path / "b"),
                 *stage2, "--qlora"]) == 0
    step = ckpt.step_dir_name(2)
    for name in ("adapter_model.safetensors", "medusa_lm_head.safetensors"):
        a = (tmp_path / "a" / "checkpoints" / step / name).read_bytes()
        assert a == (tmp_path / "b" / "checkpoints" / step / name).read_bytes(), name
    [result] = _generate(["--medusa", str(tmp_path / "a" / "checkpoints" / step), "--compare"])
    assert result.decoded.new_ids == result.plain.new_ids
    # The --qlora run's heads on the base quantised as it loads: what the 4-bit checkpoint's heads decode.
    [requantised] = _generate(["--medusa", str(tmp_path / "b" / "checkpoints" / step), "--compare", "--qlora-base"])
    assert requantised.decoded.new_ids == requantised.plain.new_ids == result.decoded.new_ids
    log = io.StringIO()
    run_generate(build_parser().parse_args(["generate", "--medusa", str(tmp_path / "b" / "checkpoints" / step),
                                            "--prompt", "x", "--max-new-tokens", "1", "--device", "cpu"]),
                 out=io.StringIO(), log=log)
    assert "trained with --qlora, against its base quantised to NF4; it goes onto the dense base" in log.getvalue()
    capsys.readouterr()
    assert main(["train-medusa", "--model", str(bnb), "--data", str(data), "--output-dir", str(tmp_path / "c"),
                 *RUN, "--stage", "2"]) != 0
    assert "bitsandbytes 4-bit checkpoint" in capsys.readouterr().err


def _lora_checkpoint(model, data, out, *extra):
    """A 2-step `train --lora-r` run's last checkpoint: a PEFT adapter directory with the tokenizer files."""
    assert main(["train", "--model", str(model), "--data", str(data), "--output-dir", str(out), *RUN[:-2],
                 "--lora-r", "4", "--lora-alpha", "8", *extra]) == 0
    return out / "checkpoints" / ckpt.step_dir_name(2)


def test_generate_with_a_lora_adapter_decodes_the_trained_model(base_and_data, tmp_path, capsys):
    """`generate --model BASE --adapter DIR` and `generate --model DIR` (an adapter alone, its base named in
    adapter_config.json) decode what the merged checkpoint decodes; the adapter's own base is not the base alone."""
    base, data = base_and_data
    adapter = _lora_checkpoint(base, data, tmp_path / "run")
    assert main(["merge-lora", "--adapter", str(adapter), "--out", str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    [merged] = _generate(["--model", str(tmp_path / "merged")])
    [named] = _generate(["--model", str(base), "--adapter", str(adapter)])
    [alone] = _generate(["--model", str(adapter)])
    assert named.decoded.new_ids == alone.decoded.new_ids == merged.decoded.new_ids
    capsys.readouterr()
    assert main(["generate", "--model", str(adapter), "--adapter", str(adapter), "--prompt", "x", "--device",
                 "cpu"]) == 2
    assert "is a LoRA adapter directory and --adapter names another" in capsys.readouterr().err
    assert main(["generate", "--model", str(base), "--adapter", str(base), "--prompt", "x", "--device", "cpu"]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_generate_with_an_adapter_trained_on_a_bitsandbytes_checkpoint(base_and_data, bnb, tmp_path):
    """An adapter trained on a 4-bit checkpoint as it is names that checkpoint: `generate --model ADAPTER` decodes on
    its NF4 base with the adapter, as the model of Python's load_bnb_4bit + load_adapter does."""
    from liger_models.lora import load_adapter

    _, data = base_and_data
    adapter = _lora_checkpoint(bnb, data, tmp_path / "run")
    [result] = _generate(["--model", str(adapter)])
    model = load_bnb_4bit(bnb, dtype=torch.float32)
    load_adapter(model, adapter)
    ids = torch.tensor([result.prompt_ids])
    expected = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result.decoded.new_ids == expected and len(expected) == 12


def test_generate_on_the_qlora_base_a_qlora_adapter_trained_against(base_and_data, bnb, tmp_path, capsys):
    """`generate --qlora-base` quantises the dense base to NF4 as `train --qlora` did: a --qlora adapter decodes as
    Python's quantize_base_ + load_adapter model does, and as on the bitsandbytes 4-bit save of the same base.
    Without the option, generate and merge-lora say that such an adapter goes onto the dense base (and say nothing
    of a plain LoRA adapter's); a 4-bit checkpoint, NF4 already, is refused the option."""
    from liger_models.lora import load_adapter, quantize_base_
    from liger_models.recipes.decoding import load_models, locate

    base, data = base_and_data
    adapter = _lora_checkpoint(base, data, tmp_path / "run", "--qlora")
    [result] = _generate(["--model", str(adapter), "--qlora-base"])
    [on_bnb] = _generate(["--model", str(bnb), "--adapter", str(adapter)])
    model = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    quantize_base_(model)
    load_adapter(model, adapter)
    ids = torch.tensor([result.prompt_ids])
    expected = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result.decoded.new_ids == on_bnb.decoded.new_ids == expected and len(expected) == 12
    loaded, _ = load_models(locate(str(adapter), None), torch.float32, torch.device("cpu"), qlora_base=True)
    quantised = [m for m in loaded.modules() if isinstance(m, LoraLinear) and m.quant is not None]
    assert len(quantised) == 7 * loaded.config.num_hidden_layers and all(m.lora_A is not None for m in quantised)
    # Without the option the adapter goes onto the dense base, and the log says what its checkpoint records.
    log = io.StringIO()
    run_generate(build_parser().parse_args(["generate", "--model", str(adapter), "--prompt", "x", "--max-new-tokens",
                                            "1", "--device", "cpu"]), out=io.StringIO(), log=log)
    assert f"[adapter] {adapter} trained with --qlora, against its base quantised to NF4" in log.getvalue()
    capsys.readouterr()
    assert main(["merge-lora", "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    assert "trained with --qlora" in capsys.readouterr().err
    assert main(["merge-lora", "--adapter", str(adapter), "--out", str(tmp_path / "merged"), "--qlora-base"]) == 0
    assert "trained with --qlora" not in capsys.readouterr().err
    plain = _lora_checkpoint(base, data, tmp_path / "plain")
    assert main(["merge-lora", "--adapter", str(plain), "--out", str(tmp_path / "merged")]) == 0
    assert "trained with --qlora" not in capsys.readouterr().err
    assert main(["generate", "--model", str(bnb), "--qlora-base", "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--qlora-base: " in err and "bitsandbytes 4-bit checkpoint, which loads as an NF4 base already" in err
