"""The parity harness itself (tests/models/parity.py) fails a wrong model: its bounds widen only with the measured
spread of float32 runs, never past an error every run shows."""
import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM

from .parity import build_hf, check_parity, save_hf


@pytest.mark.parametrize("relative", [1e-3, 3e-4])
def test_a_slightly_wrong_weight_fails_even_where_the_bound_takes_ulp_moved_copies(tmp_path, relative):
    # Random q/k biases make the attention gradients ill-conditioned (the bound may rise above its 1e-4 floor and
    # ours' ulp-moved copies are consulted); one k-norm weight off by `relative` must still fail.
    hf = build_hf(transformers.Qwen3Config, head_dim=16, attention_bias=True, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.3)
    directory = save_hf(hf, tmp_path / "hf")
    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        ours.model.layers[1].self_attn.k_norm.weight.mul_(1 + relative)
    with pytest.raises(AssertionError, match="differ"):
        check_parity(hf, directory, seq_len=12, ours=ours)
