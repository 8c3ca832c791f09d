"""Llama vs transformers: logits, loss, gradients; rope variants; v4 and v5 config styles; sharded checkpoints."""

import pytest
import torch
import transformers

from liger_models import LigerLlamaForCausalLM, LlamaConfig

from .parity import build_hf, check_parity, check_roundtrip, save_hf

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


@pytest.mark.parametrize("v4_style", [False, True], ids=["v5-config", "v4-config"])
def test_llama3_rope_gqa_head_dim_biases_sharded(tmp_path, v4_style):
    hf = build_hf(transformers.LlamaConfig, head_dim=32, attention_bias=True, mlp_bias=True,
                  rope_parameters=dict(LLAMA3_ROPE))
    save_hf(hf, tmp_path / "hf", max_shard_size="40KB", v4_style=v4_style)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = check_parity(hf, tmp_path / "hf", seq_len=20, batch=2)
    assert isinstance(ours, LigerLlamaForCausalLM) and ours.config.rope_scaling["rope_type"] == "llama3"
    assert ours.config.rope_theta == 500000.0 and ours.config.head_dim == 32


def test_a_sliding_window_key_is_ignored_as_hf_does(tmp_path):
    # HF's Llama has no sliding window: a stray "sliding_window" in config.json changes nothing there, nor here.
    hf = build_hf(transformers.LlamaConfig, sliding_window=4)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=16)
    assert ours.config.layer_sliding_window(0) is None
    assert ours.config.to_hf()["sliding_window"] == 4  # still round-trips


def test_tied_linear_rope_and_roundtrip(tmp_path):
    hf = build_hf(transformers.LlamaConfig, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=16)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    check_roundtrip(ours, tmp_path / "ours")


@pytest.mark.parametrize("seq_len", [12, 24], ids=["below-max-pos", "above-max-pos"])
def test_dynamic_rope(tmp_path, seq_len):
    hf = build_hf(transformers.LlamaConfig, max_position_embeddings=16,
                  rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=seq_len, grads=False)


def test_untied_roundtrip_sharded(tmp_path):
    ours = LigerLlamaForCausalLM.from_config(LlamaConfig.tiny())
    check_roundtrip(ours, tmp_path / "ours", max_shard_size="40KB")
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    again = LigerLlamaForCausalLM.from_pretrained(tmp_path / "ours")
    for (n, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_partial_rotary_factor_is_ignored_as_hf_does(tmp_path):
    # HF's Llama (and Mistral, Qwen2, Gemma) rotates whole heads whatever partial_rotary_factor says; only Phi3
    # reads it.
    hf = build_hf(transformers.LlamaConfig, partial_rotary_factor=0.5)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=12, grads=False)
    assert ours.config.rotary_dim == ours.config.head_dim
    assert ours.config.to_hf()["rope_parameters"]["partial_rotary_factor"] == 0.5  # still round-trips
