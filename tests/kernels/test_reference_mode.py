"""Fusion off for debugging: ``reference_mode()`` / ``LIGER_MODELS_REFERENCE=1`` run every op's PyTorch reference.

On the CPU the Triton kernels run in the interpreter, so a training step normally launches them; with fusion off it
launches none and still matches HF transformers. On the GPU the same step with fusion off matches HF eager.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import triton
from triton.runtime import interpreter

from liger_models import AutoLigerForCausalLM, reference_mode
from liger_models.kernels._dispatch import reference_forced
from liger_models.train.optim import FusedAdamW

from ..models.parity import build_hf, max_rel, save_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def launches(monkeypatch):
    """Counts Triton kernel launches (interpreted or compiled) while the test runs."""
    count = [0]
    for cls in (interpreter.InterpretedFunction, triton.runtime.jit.JITFunction):
        original = cls.run

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", counted)
    return count


def _training_step(model, ids, labels) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    loss = model(ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    FusedAdamW(model.parameters(), lr=1e-3).step()
    return loss.item(), grads


def _pair(tmp_path, device="cpu"):
    hf = build_hf(transformers.LlamaConfig)
    directory = save_hf(hf, tmp_path / "llama")
    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32, device=device)
    return hf.to(device), ours


def _batch(device="cpu"):
    ids = torch.randint(3, 128, (2, 13), device=device)
    labels = ids.clone()
    labels[1, :4] = -100
    return ids, labels


def _hf_step(hf, ids, labels):
    hf.train()
    loss = hf(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in hf.named_parameters()}


def _assert_matches_hf(ours_step, hf_step, tol: float) -> None:
    (loss, grads), (ref_loss, ref_grads) = ours_step, hf_step
    assert abs(loss - ref_loss) <= tol * abs(ref_loss)
    for name, ref in ref_grads.items():
        if name == "lm_head.weight" and name not in grads:
            continue
        assert max_rel(grads[name], ref) < tol * 10, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreted launches: the CPU test")
def test_reference_mode_launches_no_kernel_and_matches_hf(tmp_path, launches):
    hf, ours = _pair(tmp_path)
    ids, labels = _batch()
    with reference_mode():
        assert reference_forced()
        step = _training_step(ours, ids, labels)
    assert launches[0] == 0, f"{launches[0]} Triton launches with fusion off"
    assert not reference_forced()
    _assert_matches_hf(step, _hf_step(hf, ids, labels), 2e-5)

    # The same step with fusion on launches the kernels (the count above could fail).
    _, ours_fused = _pair(tmp_path / "again")
    _training_step(ours_fused, ids, labels)
    assert launches[0] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreted launches: the CPU test")
def test_environment_variable_turns_fusion_off_for_a_whole_process(tmp_path):
    code = (
        "import torch, triton\n"
        "from triton.runtime import interpreter\n"
        "count = [0]\n"
        "original = interpreter.InterpretedFunction.run\n"
        "def counted(self, *a, **k):\n"
        "    count[0] += 1\n"
        "    return original(self, *a, **k)\n"
        "interpreter.InterpretedFunction.run = counted\n"
        "from liger_models import LlamaConfig, LigerLlamaForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=1)\n"
        "model = LigerLlamaForCausalLM.from_config(cfg).train()\n"
        "ids = torch.randint(0, 64, (1, 8))\n"
        "model(ids, labels=ids).loss.backward()\n"
        "print(count[0])\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    counts = {}
    for value in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", code], env={**env, "LIGER_MODELS_REFERENCE": value},
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        counts[value] = int(out.stdout.split()[-1])
    assert counts["1"] == 0 and counts["0"] > 0, counts


def test_reference_mode_nests_and_restores():
    assert not reference_forced()
    with reference_mode():
        with reference_mode():
            assert reference_forced()
        assert reference_forced()
    assert not reference_forced()


@pytest.mark.gpu
def test_reference_mode_on_the_gpu_matches_hf_eager(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf, ours = _pair(tmp_path, "cuda")
    ids, labels = _batch("cuda")
    with reference_mode():
        step = _training_step(ours, ids, labels)
    _assert_matches_hf(step, _hf_step(hf, ids, labels), 2e-5)
