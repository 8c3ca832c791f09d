"""GPU (`pytest -m gpu`): the training recipes on CUDA with the Triton kernels, bf16, fused AdamW."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from liger_models.cli import build_parser
from liger_models.medusa import MedusaModel
from liger_models.recipes import run_demo
from liger_models.recipes import train_causal_lm, train_medusa

pytestmark = pytest.mark.gpu


def _args(command, model_dir, data, out, *extra):
    return build_parser().parse_args([
        command, "--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--seq-len", "64",
        "--batch-size", "4", "--grad-accum", "2", "--max-steps", "12", "--save-every", "6", "--lr", "3e-3",
        "--device", "cuda", "--dtype", "bf16", "--quiet", *extra])


def test_causal_lm_bf16_learns_and_resumes(tiny_model_dir, text_file, tmp_path):
    full = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "a", "--activation-checkpointing"))
    losses = [m["loss"] for m in full.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3
    assert full.history[-1]["mem_gib"] > 0
    # Resume from step 6: same data and state, so the next losses agree to bf16 kernel nondeterminism.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000006", tmp_path / "b" / "checkpoints" / "step_000006")
    resumed = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "b", "--activation-checkpointing",
                                    "--resume", "auto"))
    assert [m["step"] for m in resumed.history] == list(range(7, 13))
    for a, b in zip(full.history[6:], resumed.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)


@pytest.mark.parametrize("stage, extra", [(1, ("--share-lm-head",)), (2, ("--schedule", "sine_0.5"))])
def test_medusa_bf16_on_cuda(stage, extra, tiny_model_dir, text_file, tmp_path):
    result = train_medusa(_args("train-medusa", tiny_model_dir, text_file, tmp_path, "--stage", str(stage),
                                "--num-heads", "3", *extra))
    last = result.history[-1]
    assert math.isfinite(last["loss"]) and len(last["head_top1"]) == 3
    saved = load_file(result.checkpoint / "medusa_lm_head.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    medusa = MedusaModel.from_pretrained(str(result.checkpoint), dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, medusa.config.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        out = medusa(ids)
    assert out.head_logits.shape[:2] == (3, 1) and torch.isfinite(out.head_logits.float()).all()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[-1])["tokens_per_s"] > 0


def test_quick_demo_on_cuda(tmp_path):
    result = run_demo(build_parser().parse_args(["demo", "--quick", "--output-dir", str(tmp_path), "--device",
                                                 "cuda"]))
    # (Not asserting greedy equality: in bf16 the batched tree verification may flip near-tied argmaxes.)
    assert result["tokens_per_step"] >= 1.0 and len(result["after"]["top1"]) == 3


@pytest.mark.parametrize("optimizer", ["torch", "liger-models"])
def test_optimizer_in_backward_matches_fused_adamw_on_cuda(tiny_tied_model_dir, optimizer):
    """bf16 on CUDA with torch's fused AdamW (multi-tensor for the normal step, one tensor per call in backward) or
    the project's FusedAdamW, and the Triton kernels: the same weights bit for bit after every step, with at most
    two gradients alive at once."""
    from liger_models import AutoLigerForCausalLM
    from liger_models.train.optim import FusedAdamW
    from liger_models.train.step_in_backward import OptimizerInBackward

    models = [AutoLigerForCausalLM.from_pretrained(tiny_tied_model_dir, dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]
    if optimizer == "torch":
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=True) for m in models]
    else:
        opts = [FusedAdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in models]
    OptimizerInBackward(opts[1])
    live = []
    for p in models[1].parameters():
        p.register_post_accumulate_grad_hook(lambda _: live.append(sum(q.grad is not None
                                                                      for q in models[1].parameters())))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    vocab = models[0].config.vocab_size
    for _ in range(3):
        ids = torch.randint(0, vocab, (4, 64), device="cuda")
        with sdpa_kernel(SDPBackend.MATH):  # the flash/cuDNN backwards accumulate dq with atomics (run to run noise)
            models[0](ids, labels=ids).loss.backward()
            opts[0].step()
            opts[0].zero_grad(set_to_none=True)
            models[1](ids, labels=ids).loss.backward()
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(a, b), name
    assert max(live) <= 2


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_bitsandbytes_optimizer_learns_on_cuda(name, tiny_model_dir, text_file, tmp_path):
    """bitsandbytes' CUDA update kernels: the loss falls as with AdamW, and the resume's first step (torch's
    optimizer-state loading makes a zero-gradient, zero-lr step on the fresh optimizer first) leaves the weights
    unharmed: the resumed losses follow the uninterrupted run's."""
    pytest.importorskip("bitsandbytes")
    full = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "a", "--optimizer", name))
    losses = [m["loss"] for m in full.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000006", tmp_path / "b" / "checkpoints" / "step_000006")
    resumed = train_causal_lm(_args("train", tiny_model_dir, text_file, tmp_path / "b", "--optimizer", name,
                                    "--resume", "auto"))
    for a, b in zip(full.history[6:], resumed.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
