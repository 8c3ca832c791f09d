"""FSDP2 (`fully_shard`) on 2 CPU processes (gloo, launched by torchrun) matches one process with the same global
batch, and its checkpoints hold the full gathered weights, loadable on one process: full fine-tuning, LoRA adapters
on a frozen base (dense, or NF4 whose codes and scales shard with their layer), and mixture-of-experts models with
their load-balancing loss."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from liger_models import LigerMixtralForCausalLM, LigerQwen3MoeForCausalLM, MixtralConfig, Qwen3MoeConfig
from liger_models.cli import build_parser
from liger_models.hub import copy_tokenizer_files
from liger_models.medusa import MedusaModel
from liger_models.modules.lora_linear import NF4Weight
from liger_models.recipes import train_causal_lm, train_medusa
from liger_models.train import checkpointing as ckpt
from tests.helpers import run_two_ranks

pytestmark = pytest.mark.usefixtures("reference_path")


# Two ranks sum gradients in another order than one process: they differ in the last bits. AdamW's step m / (√v + ε)
# turns such a difference into up to a whole lr-sized step where a gradient element is a cancellation near ε (1e-8
# by default): one element in a few hundred then differed by 1.7e-3 after three steps (CI, seed 2141818068). At ε
# 1e-3, far above that rounding noise, the step is a smooth function of the gradient, and two ranks' tensors match
# one process's to 8.4e-8 (every tensor of this file's tests, three seeds; MAX_DIFF leaves an order of magnitude).
ADAM_EPS = "1e-3"
MAX_DIFF = 1e-6


def _medusa_args(model_dir, data, out, batch_size):
    return ["train-medusa", "--model", str(model_dir), "--data", str(data), "--output-dir", str(out),
            "--stage", "2", "--num-heads", "2", "--seq-len", "32", "--batch-size", str(batch_size),
            "--grad-accum", "2", "--max-steps", "3", "--save-every", "2", "--lr", "3e-3", "--warmup-steps", "1",
            "--adam-eps", ADAM_EPS, "--dtype", "fp32", "--device", "cpu", "--quiet", "--eval-data", str(data),
            "--eval-every", "2", "--eval-batches", "2"]


def test_fsdp2_two_processes_match_one(tiny_tied_model_dir, text_file, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "LIGER_DEBUG": "1"}
    run_two_ranks(["-m", "liger_models.cli", *_medusa_args(tiny_tied_model_dir, text_file, tmp_path / "fsdp", 2)],
                  env)

    single = train_medusa(build_parser().parse_args(_medusa_args(tiny_tied_model_dir, text_file, tmp_path / "one", 4)))
    fsdp = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in fsdp] == [1, 2, 3]
    for a, b in zip(single.history, fsdp):
        assert a["targets"] == b["targets"]  # the same global batch, split over two ranks
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(b["head_loss"], a["head_loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-4, atol=0)
    # Evaluation: the same eval windows (a round = one micro-batch per rank) give the same numbers.
    evals = [json.loads(line) for line in (tmp_path / "fsdp" / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in evals] == [m["step"] for m in single.evals] == [2, 3]
    for a, b in zip(single.evals, evals):
        assert a["targets"] == b["targets"]
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
        assert b["head_top1"] == a["head_top1"]

    # The FSDP checkpoint holds full tensors (not rank 0's shard), equal to the single-process run's.
    ckpt_fsdp = tmp_path / "fsdp" / "checkpoints" / "step_000003"
    for name in ("model.safetensors", "medusa_lm_head.safetensors"):
        _assert_same_tensors(load_file(single.checkpoint / name), load_file(ckpt_fsdp / name))
    assert "lm_head.weight" not in load_file(ckpt_fsdp / "model.safetensors")  # tied head stored once

    # A 2-rank checkpoint resumes on one process and continues as the 2-rank run did.
    import shutil

    shutil.copytree(tmp_path / "fsdp", tmp_path / "resumed", ignore=shutil.ignore_patterns("step_000003"))
    resumed = train_medusa(build_parser().parse_args(
        _medusa_args(tiny_tied_model_dir, text_file, tmp_path / "resumed", 4) + ["--resume", "auto"]))
    assert [m["step"] for m in resumed.history] == [3]
    torch.testing.assert_close(resumed.history[0]["loss"], fsdp[2]["loss"], rtol=1e-5, atol=0)

    # ... and loads on one process with the same logits.
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        out_f = MedusaModel.from_pretrained(str(ckpt_fsdp))(ids)
        out_s = MedusaModel.from_pretrained(str(single.checkpoint))(ids)
    torch.testing.assert_close(out_f.logits, out_s.logits, rtol=0, atol=1e-5)  # 3e-7 measured
    torch.testing.assert_close(out_f.head_logits, out_s.head_logits, rtol=0, atol=1e-5)


def test_outputs_are_pytree_nodes():
    """FSDP2 (torch ≤ 2.11) hooks its pre-backward onto the grad-requiring tensors it finds by pytree-flattening the
    root module's output; a dataclass it cannot see into hides the loss (Medusa stage 1 then never reduced the
    heads' gradients on 2 GPUs). Both output classes must flatten to their tensors and back."""
    import torch.utils._pytree as pytree

    from liger_models.medusa.loss import MedusaOutput
    from liger_models.modules import CausalLMOutput

    loss = torch.randn((), requires_grad=True) * 2
    for out in (MedusaOutput(loss=loss, head_losses=torch.rand(3)), CausalLMOutput(loss=loss, logits=torch.rand(2))):
        leaves, spec = pytree.tree_flatten(out)
        assert any(t is loss for t in leaves), type(out).__name__
        assert pytree.tree_unflatten(leaves, spec) == out


def test_fsdp2_stage1_trains_heads_like_one_process(tiny_tied_model_dir, text_file, tmp_path):
    """Stage 1 under FSDP2: the base runs under no_grad, so only the heads (each its own FSDP unit) have gradients;
    two ranks must train them exactly as one process does."""
    def args(out, batch_size):
        return ["train-medusa", "--model", str(tiny_tied_model_dir), "--data", str(text_file), "--output-dir",
                str(out), "--stage", "1", "--num-heads", "2", "--seq-len", "32", "--batch-size", str(batch_size),
                "--max-steps", "3", "--save-every", "3", "--lr", "3e-3", "--warmup-steps", "1", "--adam-eps",
                ADAM_EPS, "--dtype", "fp32", "--device", "cpu", "--quiet"]

    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    run_two_ranks(["-m", "liger_models.cli", *args(tmp_path / "fsdp", 2)], env)
    single = train_medusa(build_parser().parse_args(args(tmp_path / "one", 4)))
    fsdp = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert len(fsdp) == len(single.history) == 3
    # The heads train at all: every step has gradients to step on (three steps on three different batches are too few
    # for a loss drop to beat the batch-to-batch spread: seed 193878452 went 1.664 → 1.674).
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in single.history)
    for a, b in zip(single.history, fsdp):
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-4, atol=0)
    _assert_same_tensors(load_file(single.checkpoint / "medusa_lm_head.safetensors"),
                         load_file(tmp_path / "fsdp" / "checkpoints" / "step_000003" / "medusa_lm_head.safetensors"))


def test_more_processes_per_node_than_gpus_fails_clearly(monkeypatch):
    """torchrun --nproc-per-node above the GPU count: CUDA's "invalid device ordinal" named neither cause."""
    from liger_models.train import distributed as D

    visible = int(torch.randint(1, 4, ()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: pytest.fail(f"set_device({dev}) was reached"))
    monkeypatch.setenv("WORLD_SIZE", str(visible + 2))
    monkeypatch.setenv("RANK", str(visible + 1))
    monkeypatch.setenv("LOCAL_RANK", str(visible + 1))
    with pytest.raises(RuntimeError, match=f"LOCAL_RANK {visible + 1} .* sees {visible} GPU"):
        D.init_distributed("cuda")


def _torchrun(args: list[str]) -> None:
    """``liger-models <args>`` on two CPU processes under torchrun (gloo)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "LIGER_DEBUG": "1"}
    run_two_ranks(["-m", "liger_models.cli", *args], env)


def _one_process(args: list[str]):
    run = train_causal_lm if args[0] == "train" else train_medusa
    return run(build_parser().parse_args(args))


def _logged(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(expected: list[dict], got: list[dict]) -> None:
    """The same global batches (targets), loss and gradient norm, step for step."""
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(expected, got):
        assert a["targets"] == b["targets"]
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-4, atol=0)


def _assert_same_tensors(expected: dict, got: dict) -> None:
    """Whole tensors (not one rank's shard) under the same names, each element within MAX_DIFF (see ADAM_EPS)."""
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=MAX_DIFF, msg=key)


def _without_last_step(run, copy):
    """A copy of run's output directory as it stood after step 2 (step 3's checkpoint and log lines dropped)."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("step_000003"))
    return copy


def _lora_args(command, model_dir, data, out, batch_size):
    medusa = ["--stage", "2", "--num-heads", "2"] if command == "train-medusa" else []
    return [command, "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), *medusa,
            "--seq-len", "32", "--batch-size", str(batch_size), "--grad-accum", "2", "--max-steps", "3",
            "--save-every", "2", "--keep-last", "3", "--lr", "1e-2", "--warmup-steps", "1", "--adam-eps", ADAM_EPS,
            "--dtype", "fp32", "--device", "cpu", "--quiet", "--lora-r", "4", "--lora-alpha", "8",
            "--lora-modules-to-save", "embed_tokens,lm_head"]


@pytest.mark.parametrize("command, qlora", [("train", False), ("train-medusa", False), ("train", True),
                                            ("train-medusa", True)],
                         ids=["train-lora", "train-medusa-lora", "train-qlora", "train-medusa-qlora"])
def test_fsdp2_lora_matches_one_process_and_resumes_on_either(command, qlora, tiny_model_dir, text_file, tmp_path,
                                                              monkeypatch):
    """LoRA under FSDP2 (``train``, and Medusa stage 2 through adapters), and QLoRA (``train --qlora`` and
    ``train-medusa --stage 2 --qlora``: an NF4 base,
    whose codes and scales shard with their layers, test_fsdp2_shards_the_nf4_base; Medusa stage 2 adds heads,
    which hold none): the adapters and modules_to_save shard with their layers and the base stays frozen; two ranks
    train as one process does, and their checkpoint holds the whole adapter (PEFT's files, written by rank 0), which
    resumes on two processes or one, as one process's checkpoint resumes on two."""
    def args(out, batch_size):
        return _lora_args(command, tiny_model_dir, text_file, out, batch_size) + (["--qlora"] if qlora else [])

    dequantised = []
    real = NF4Weight.dequantize
    # The one-process runs train on the NF4 base (counted here); two ranks match them, so theirs does too.
    monkeypatch.setattr(NF4Weight, "dequantize", lambda self, dtype=None: dequantised.append(1) or real(self, dtype))
    _torchrun(args(tmp_path / "fsdp", 2))
    single = _one_process(args(tmp_path / "one", 4))
    assert bool(dequantised) == qlora
    fsdp = _logged(tmp_path / "fsdp")
    _assert_same_steps(single.history, fsdp)

    last = tmp_path / "fsdp" / "checkpoints" / "step_000003"
    files = ["adapter_model.safetensors", *(["medusa_lm_head.safetensors"] if command == "train-medusa" else [])]
    assert (last / "adapter_config.json").is_file()
    assert not any(p.name.startswith("model") for p in last.iterdir())  # no copy of the base
    saved = {name: load_file(last / name) for name in files}
    for name in files:
        _assert_same_tensors(load_file(single.checkpoint / name), saved[name])
    adapter = saved["adapter_model.safetensors"]
    assert {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"} <= adapter.keys()
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())  # B left its zeros
    # The frozen base has no optimizer state: only the adapters, modules_to_save (and heads) have.
    trained = {k.removeprefix("base_model.model.") for k in adapter}
    prefix = "base." if command == "train-medusa" else ""
    optimized = set(ckpt.load_trainer_state(last)["optimizer"]["state"])
    assert {k for k in optimized if not k.startswith("heads.")} == {prefix + k for k in trained}

    # Step 3 again from step 2's checkpoint: two processes' on two (bit for bit) and on one, and one process's on
    # two, each as the run it continues.
    again = _without_last_step(tmp_path / "fsdp", tmp_path / "again")
    _torchrun([*args(again, 2), "--resume", "auto"])
    for name in files:
        assert (again / "checkpoints" / "step_000003" / name).read_bytes() == (last / name).read_bytes(), name
    on_one = _one_process([*args(_without_last_step(tmp_path / "fsdp", tmp_path / "on_one"), 4), "--resume", "auto"])
    _assert_same_steps(fsdp[2:], on_one.history)
    on_two = _without_last_step(tmp_path / "one", tmp_path / "on_two")
    _torchrun([*args(on_two, 2), "--resume", "auto"])
    _assert_same_steps(single.history[2:], _logged(on_two)[2:])
    for name in files:
        _assert_same_tensors(load_file(single.checkpoint / name),
                             load_file(on_two / "checkpoints" / "step_000003" / name))


NF4_SHARD_SCRIPT = """
import gc, json, os, sys
import torch
from torch.distributed.tensor import DTensor
from liger_models import AutoLigerForCausalLM
from liger_models.lora import LoraSettings
from liger_models.modules.lora_linear import NF4Weight
from liger_models.recipes.lora import attach
from liger_models.train import distributed as D

info = D.init_distributed("cpu")
torch.manual_seed(0)  # the same adapters (B drawn: not zero) and batch on both ranks
model = AutoLigerForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[3]))
attach(model, LoraSettings(r=4, alpha=8, targets="all-linear", init=False), qlora=True, resume=None)
ids = torch.randint(0, model.config.vocab_size, (2, 24))
alone = model(ids, labels=ids).loss
alone.backward()
grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
model.zero_grad(set_to_none=True)
D.apply_fsdp(model, model.model.layers, info.device)


def nf4():
    return {f"{n}.{k}": p for n, m in model.named_modules() if isinstance(m, NF4Weight)
            for k, p in m.named_parameters(recurse=False)}


def held():  # name -> [this rank's elements, the whole's, dtype], for each sharded (DTensor) NF4 parameter
    return {n: [p.to_local().numel(), p.numel(), str(p.to_local().dtype)] for n, p in nf4().items()
            if isinstance(p, DTensor)}


sharded = held()
loss = model(ids, labels=ids).loss
loss.backward()
out = {"nf4": len(nf4()), "sharded": sharded, "after_backward": held(), "loss": [alone.item(), loss.item()],
       "grad_rel": {n: ((p.grad.full_tensor() - grads[n]).abs().max() / grads[n].abs().max()).item()
                    for n, p in model.named_parameters() if p.requires_grad},
       "nf4_grads": sum(p.grad is not None for p in nf4().values())}
with open(os.path.join(sys.argv[2], f"rank{info.rank}.json"), "w") as f:
    json.dump(out, f)
# The FSDP model must go before the process group (distributed.destroy_distributed says why): alive at exit, it tore
# its connections down from the garbage collector's thread now and then, and the process aborted.
del model, loss
gc.collect()
D.destroy_distributed()
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp2_shards_the_nf4_base(dtype, tiny_model_dir, tmp_path):
    """``fully_shard`` shards an NF4 base's codes and scales (frozen uint8 Parameters) with their layer: each of two
    ranks holds half of each, before a step and again after it, while the layer's forward and backward dequantise
    the whole (all-gathered) weight: the loss and every adapter gradient (averaged over ranks that ran the same
    batch) are the unsharded model's. Nothing gives the NF4 tensors a gradient. bf16: a unit that mixes bf16
    norms, fp32 adapters and uint8 codes."""
    script = tmp_path / "nf4_shards.py"
    script.write_text(NF4_SHARD_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    run_two_ranks([str(script), str(tiny_model_dir), str(tmp_path), dtype], env)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    linears = config["num_hidden_layers"] * 7  # q, k, v, o, gate, up, down
    for rank in ranks:
        assert rank["nf4"] == 2 * linears  # codes and scales of each
        assert rank["sharded"].keys() == rank["after_backward"].keys() and len(rank["sharded"]) == 2 * linears
        assert rank["after_backward"] == rank["sharded"]  # gathered for the step, freed after it
        assert rank["nf4_grads"] == 0
        torch.testing.assert_close(rank["loss"][1], rank["loss"][0], rtol=1e-6, atol=0)
        assert len(rank["grad_rel"]) == 2 * linears and max(rank["grad_rel"].values()) <= 1e-6, rank["grad_rel"]
    for name, (mine, whole, local_dtype) in ranks[0]["sharded"].items():
        theirs, _, _ = ranks[1]["sharded"][name]
        assert local_dtype == "torch.uint8", name
        assert mine == -(-whole // 2) and mine + theirs == whole, (name, mine, theirs, whole)  # dim-0 chunks
    held = [sum(v[0] for v in rank["sharded"].values()) for rank in ranks]
    whole = sum(v[1] for v in ranks[0]["sharded"].values())
    assert all(abs(h / whole - 0.5) < 0.01 for h in held), (held, whole)


MOE_FAMILIES = {"qwen3_moe": (LigerQwen3MoeForCausalLM, Qwen3MoeConfig),
                "mixtral": (LigerMixtralForCausalLM, MixtralConfig)}


def _tiny_moe_dir(family, tokenizer_dir, path):
    """A tiny random MoE model with the tokenizer of ``tokenizer_dir``, its load-balancing loss on and weighted
    enough (0.1) to move the loss in its third digit."""
    cls, config_cls = MOE_FAMILIES[family]
    llama = json.loads((tokenizer_dir / "config.json").read_text())
    config = config_cls.tiny(vocab_size=llama["vocab_size"], bos_token_id=None, eos_token_id=llama["eos_token_id"],
                             pad_token_id=None, output_router_logits=True, router_aux_loss_coef=0.1)
    cls.from_config(config).save_pretrained(path)
    copy_tokenizer_files(tokenizer_dir, path)
    return path


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_fsdp2_moe_matches_one_process(family, tiny_model_dir, text_file, tmp_path):
    """Stacked expert tensors shard like any other, the load-balancing loss is the global batch's (not the sum of
    each rank's, which is not additive: it multiplies two means over the batch), and the checkpoint holds every
    expert under HF's per-expert names; it resumes on one process as the two-rank run continued."""
    model_dir = _tiny_moe_dir(family, tiny_model_dir, tmp_path / "model")

    def args(out, batch_size):
        return ["train", "--model", str(model_dir), "--data", str(text_file), "--output-dir", str(out),
                "--seq-len", "32", "--batch-size", str(batch_size), "--grad-accum", "2", "--max-steps", "3",
                "--save-every", "2", "--lr", "3e-3", "--warmup-steps", "1", "--adam-eps", ADAM_EPS, "--dtype",
                "fp32", "--device", "cpu", "--quiet", "--eval-data", str(text_file), "--eval-every", "2",
                "--eval-batches", "2"]

    _torchrun(args(tmp_path / "fsdp", 2))
    single = _one_process(args(tmp_path / "one", 4))
    fsdp = _logged(tmp_path / "fsdp")
    _assert_same_steps(single.history, fsdp)
    evals = [json.loads(line) for line in (tmp_path / "fsdp" / "eval.jsonl").read_text().splitlines()]
    assert [m["step"] for m in evals] == [m["step"] for m in single.evals] == [2, 3]
    for a, b in zip(single.evals, evals):
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
    saved = load_file(tmp_path / "fsdp" / "checkpoints" / "step_000003" / "model.safetensors")
    expert = {"qwen3_moe": "mlp.experts.3.down_proj", "mixtral": "block_sparse_moe.experts.3.w2"}[family]
    assert f"model.layers.1.{expert}.weight" in saved
    _assert_same_tensors(load_file(single.checkpoint / "model.safetensors"), saved)
    resumed = _one_process([*args(_without_last_step(tmp_path / "fsdp", tmp_path / "resumed"), 4), "--resume",
                            "auto"])
    _assert_same_steps(fsdp[2:], resumed.history)


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_fsdp2_moe_lora_matches_one_process(family, qlora, tiny_model_dir, text_file, tmp_path):
    """LoRA all-linear on a mixture-of-experts base under FSDP2, and QLoRA (its NF4 expert stacks shard as uint8
    with their layers and are dequantised per call): the adapters of the expert stacks (E·r rows each, PEFT's
    layout) and of the routers shard with their layers; two ranks train as one process does, the load-balancing
    loss over the global batch, and the checkpoint holds every adapter under PEFT's names."""
    model_dir = _tiny_moe_dir(family, tiny_model_dir, tmp_path / "model")

    def args(out, batch_size):
        return _lora_args("train", model_dir, text_file, out, batch_size) + (["--qlora"] if qlora else [])

    _torchrun(args(tmp_path / "fsdp", 2))
    single = _one_process(args(tmp_path / "one", 4))
    _assert_same_steps(single.history, _logged(tmp_path / "fsdp"))
    adapter = load_file(tmp_path / "fsdp" / "checkpoints" / "step_000003" / "adapter_model.safetensors")
    layer = "base_model.model.model.layers.1.mlp"
    for key in ("experts.base_layer.lora_A.weight", "experts.lora_B.weight", "gate.lora_B.weight"):
        assert adapter[f"{layer}.{key}"].abs().max() > 0, key
    _assert_same_tensors(load_file(single.checkpoint / "adapter_model.safetensors"), adapter)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_on_a_multimodal_checkpoint_saves_what_one_process_saves(lora, text_file, tmp_path):
    """A Gemma 3 4B-27B-style checkpoint (Gemma3ForConditionalGeneration): two ranks' checkpoint is the one process
    writes, the whole multimodal checkpoint (vision tower byte-equal) or the adapter under the multimodal model's
    names; rank 0 writes it from the gathered state, which must keep what the decoder was loaded from."""
    from liger_models.text.bpe import save_tokenizer, train_bpe_tokenizer
    from tests.helpers import EOS, shakespeare
    from tests.models.parity import build_gemma3_multimodal

    tokenizer = train_bpe_tokenizer(shakespeare(30_000).splitlines(), vocab_size=300, eos_token=EOS)
    base = tmp_path / "gemma-3-mm"
    build_gemma3_multimodal(vocab=tokenizer.get_vocab_size() + 3, eos_token_id=tokenizer.token_to_id(EOS),
                            bos_token_id=None, pad_token_id=None).save_pretrained(base)
    save_tokenizer(tokenizer, base, eos_token=EOS)

    def args(out, batch_size):
        return ["train", "--model", str(base), "--data", str(text_file), "--output-dir", str(out), "--seq-len", "16",
                "--batch-size", str(batch_size), "--grad-accum", "2", "--max-steps", "2", "--lr", "1e-2",
                "--warmup-steps", "1", "--adam-eps", ADAM_EPS, "--dtype", "fp32", "--device", "cpu", "--quiet",
                *(["--lora-r", "4", "--lora-alpha", "8"] if lora else [])]

    _torchrun(args(tmp_path / "fsdp", 2))
    single = _one_process(args(tmp_path / "one", 4))
    _assert_same_steps(single.history, _logged(tmp_path / "fsdp"))
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    saved = load_file(tmp_path / "fsdp" / "checkpoints" / "step_000002" / name)
    _assert_same_tensors(load_file(single.checkpoint / name), saved)
    if lora:
        assert all(k.startswith("base_model.model.model.language_model.layers.") for k in saved)
    else:
        source = load_file(base / "model.safetensors")
        assert saved.keys() == source.keys()
        assert all(torch.equal(saved[k], source[k]) for k in source if not k.startswith("language_model."))
