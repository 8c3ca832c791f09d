"""Training a 2-layer model per family for 30 steps: the fused model follows the reference loss curve.

CPU (CI): our model with the kernels' PyTorch reference path against transformers' own implementation, from the
same weights on the same tiny-shakespeare batches (fp32: curves equal to 1e-4; both learn). The interpreter runs of
the Triton kernels are covered step by step by the gradient parity tests.
GPU: Triton kernels against the reference ops (``reference_mode()``) in bf16, same curve within bf16 noise.
"""

import contextlib
from importlib.resources import files

import pytest
import torch
import transformers

from liger_models import GemmaConfig, LigerGemmaForCausalLM, LigerLlamaForCausalLM, LigerMistralForCausalLM, \
    LigerPhi3ForCausalLM, LigerQwen2ForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, reference_mode

from .parity import build_hf, save_hf

FAMILIES = {
    "llama": (transformers.LlamaConfig, LigerLlamaForCausalLM, LlamaConfig),
    "mistral": (transformers.MistralConfig, LigerMistralForCausalLM, MistralConfig),
    "qwen2": (transformers.Qwen2Config, LigerQwen2ForCausalLM, Qwen2Config),
    "gemma": (transformers.GemmaConfig, LigerGemmaForCausalLM, GemmaConfig),
    "phi3": (transformers.Phi3Config, LigerPhi3ForCausalLM, Phi3Config),
}
STEPS = 30


def shakespeare_batches(steps: int, batch: int, seq_len: int, device="cpu") -> list[torch.Tensor]:
    """Byte-level batches (ASCII < 128 fits the tiny vocab) from the packaged tiny-shakespeare text."""
    text = files("liger_models.data").joinpath("tiny_shakespeare.txt").read_bytes()
    data = torch.tensor(list(text[: steps * batch * seq_len]), dtype=torch.long).clamp_(max=127)
    return list(data.view(steps, batch, seq_len).to(device))


def train(model, batches, lr=1e-3) -> list[float]:
    # lr 1e-3, not higher: at 3e-3 these tiny randomly initialised models train chaotically (AdamW's normalised
    # step turns 1e-7 rounding differences into 3e-3 loss differences within a few steps, HF against itself too),
    # and the comparison would measure that amplification instead of our gradients.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_curve_matches_transformers(tmp_path, family):
    hf_config_cls, _, _ = FAMILIES[family]
    hf = build_hf(hf_config_cls, num_hidden_layers=2, pad_token_id=0).train()
    from liger_models import AutoLigerForCausalLM

    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path), dtype=torch.float32).train()
    batches = shakespeare_batches(STEPS, batch=2, seq_len=24)
    ref = train(hf, batches)
    with reference_mode():
        got = train(ours, batches)
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    # Steps agree to ~1e-7; some batches amplify that: HF against itself with weights perturbed by 1e-7 shows
    # the same one-step blips of ~1e-4 late in the run, so the max gets a 10x looser bound than the mean.
    assert sum(diffs) / len(diffs) <= 1e-4 * ref[0] and max(diffs) <= 1e-3 * ref[0], (diffs, ref)
    assert sum(got[-5:]) / 5 < 0.75 * got[0], f"did not learn: {got[0]:.3f} → {got[-5:]}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_kernels_follow_reference_curve_gpu(family):
    _, model_cls, config_cls = FAMILIES[family]
    config = config_cls.tiny(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                             vocab_size=128, max_position_embeddings=1024)
    torch.manual_seed(0)
    init = model_cls.from_config(config, dtype=torch.bfloat16, device="cuda").state_dict()
    batches = shakespeare_batches(STEPS, batch=4, seq_len=256, device="cuda")
    curves = []
    for use_reference in (False, True):
        model = model_cls.from_config(config, dtype=torch.bfloat16, device="cuda")
        model.load_state_dict(init)
        with reference_mode() if use_reference else contextlib.nullcontext():
            curves.append(train(model, batches, lr=1e-3))
    fused, ref = curves
    diffs = [abs(a - b) for a, b in zip(fused, ref)]
    assert sum(diffs) / len(diffs) <= 0.02 * ref[0] and max(diffs) <= 0.05 * ref[0], (fused, ref)
    assert sum(fused[-5:]) / 5 < 0.8 * fused[0], f"did not learn: {fused}"
