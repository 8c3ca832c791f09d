"""`liger-models train-medusa --stage 2 --lora-r …` (the Medusa-2 recipe through adapters, --qlora too): the heads
train fully and the base only through its adapters; a checkpoint is the heads plus a PEFT adapter of --model, which
MedusaModel.from_pretrained (so `generate --medusa`) attaches again; a resumed run ends bit for bit where an
uninterrupted one does."""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from liger_models import AutoLigerForCausalLM
from liger_models.cli import main
from liger_models.lora import load_adapter, lora_modules, quantize_base_
from liger_models.medusa import MedusaModel
from liger_models.recipes.configs import FinetuneConfig, MedusaTrainingConfig
from liger_models.train import checkpointing as ckpt


RUN = ["--seq-len", "32", "--batch-size", "2", "--max-steps", "4", "--save-every", "2", "--keep-last", "3",
       "--lr", "1e-2", "--warmup-steps", "1", "--device", "cpu", "--dtype", "fp32", "--quiet", "--num-heads", "2",
       "--stage", "2", "--lora-r", "4", "--lora-alpha", "8"]


pytestmark = pytest.mark.usefixtures("reference_kernels")


def _two_step_heads(base, data, tmp_path):
    """A 2-step stage-2 LoRA run's checkpoint: heads plus adapter."""
    out = tmp_path / "run"
    argv = ["train-medusa", "--model", str(base), "--data", str(data), "--output-dir", str(out), *RUN,
            "--max-steps", "2"]
    assert main(argv) == 0
    return out / "checkpoints" / ckpt.step_dir_name(2)


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_stage2_through_adapters_saves_heads_and_adapter_and_resumes_bit_for_bit(base_and_data, tmp_path, qlora):
    base, data = base_and_data
    extra = ["--qlora"] if qlora else []
    out = tmp_path / "run"
    argv = ["train-medusa", "--model", str(base), "--data", str(data), "--output-dir", str(out), *RUN, *extra]
    assert main(argv) == 0
    last = out / "checkpoints" / ckpt.step_dir_name(4)
    files = {p.name for p in last.iterdir()}
    assert {"config.json", "medusa_lm_head.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= files
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in files), files  # no base copy
    adapter = load_file(str(last / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B left its zeros

    # Loaded back: the adapter is on the base named by the heads' config, and the model is the trained one.
    medusa = MedusaModel.from_pretrained(str(last), dtype=torch.float32)
    assert medusa.stage == 2 and lora_modules(medusa.base)
    reference = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    if qlora:
        quantize_base_(reference)
        quantize_base_(medusa.base)  # the base the adapter trained against (the loader gives the bf16 one)
    load_adapter(reference, last)
    ids = torch.randint(3, reference.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(medusa.base(ids).logits, reference(ids).logits)
        assert not torch.equal(reference(ids).logits, AutoLigerForCausalLM.from_pretrained(base)(ids).logits)
    # Only the adapters and the heads train in stage 2 through LoRA.
    trainable = {n for n, p in medusa.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("heads.") for n in trainable), sorted(trainable)

    # Resumed from step 2 (step 4 removed): the same heads and adapter bytes at step 4.
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / ckpt.step_dir_name(4))
    argv = ["train-medusa", "--model", str(base), "--data", str(data), "--output-dir", str(resumed), *RUN, *extra,
            "--resume", "auto"]
    assert main(argv) == 0
    again = resumed / "checkpoints" / ckpt.step_dir_name(4)
    for name in ("adapter_model.safetensors", "medusa_lm_head.safetensors"):
        assert (again / name).read_bytes() == (last / name).read_bytes(), name


def test_generate_with_the_heads_decodes_on_the_adapted_base(base_and_data, tmp_path, capsys):
    heads = _two_step_heads(*base_and_data, tmp_path)
    capsys.readouterr()
    assert main(["generate", "--medusa", str(heads), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--device",
                 "cpu", "--dtype", "fp32", "--greedy", "--compare"]) == 0, capsys.readouterr().err


def test_stage1_with_lora_is_refused(base_and_data, tmp_path, capsys):
    base, data = base_and_data
    argv = ["train-medusa", "--model", str(base), "--data", str(data), "--output-dir", str(tmp_path / "r"), *RUN,
            "--stage", "1"]
    assert main(argv) != 0
    assert "--lora-r trains the base through adapters: that is stage 2" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "train-medusa"])
def test_lora_and_qlora_are_accepted_under_torchrun(base_and_data, tmp_path, monkeypatch, command):
    """LoRA and QLoRA train under torchrun (tests/train/test_distributed.py: the NF4 base shards with its layers);
    --qlora still needs --lora-r there."""
    base, data = base_and_data
    monkeypatch.setenv("WORLD_SIZE", "2")
    config_cls = FinetuneConfig if command == "train" else partial(MedusaTrainingConfig, stage=2)
    config_cls(model=str(base), data=[str(data)], output_dir=str(tmp_path / "r"), lora_r=4).validate()
    config_cls(model=str(base), data=[str(data)], output_dir=str(tmp_path / "r"), lora_r=4, qlora=True).validate()
    with pytest.raises(ValueError, match="give --lora-r too"):
        config_cls(model=str(base), data=[str(data)], output_dir=str(tmp_path / "r"), qlora=True).validate()


def test_heads_refuse_a_base_with_other_adapters(base_and_data, tmp_path):
    base, _ = base_and_data
    heads = _two_step_heads(*base_and_data, tmp_path)
    same = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    load_adapter(same, heads)
    MedusaModel.from_pretrained(str(heads), base=same)  # its own adapters: taken as they are
    other = AutoLigerForCausalLM.from_pretrained(base, dtype=torch.float32)
    load_adapter(other, heads)
    with torch.no_grad():
        next(iter(lora_modules(other).values())).lora_B.weight.add_(1.0)
    with pytest.raises(ValueError, match="carries other LoRA adapters than the ones .* holds for its heads"):
        MedusaModel.from_pretrained(str(heads), base=other)
