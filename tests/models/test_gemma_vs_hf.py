"""Gemma vs transformers: (1+w) norms, √hidden scale, tanh GELU (config "gelu"), MQA, head_dim ≠ hidden/heads."""

import json

import pytest
import transformers

from liger_models import AutoLigerForCausalLM, GemmaConfig, LigerGemmaForCausalLM, LlamaConfig

from .parity import build_hf, check_parity, check_roundtrip, save_hf


def test_gemma_mqa_head_dim_gelu_alias(tmp_path):
    hf = build_hf(transformers.GemmaConfig, head_dim=32, num_key_value_heads=1)
    directory = save_hf(hf, tmp_path / "hf", v4_style=True)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["hidden_act"] = "gelu"  # what the released checkpoints say; means tanh for Gemma
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=14)
    assert isinstance(ours, LigerGemmaForCausalLM) and ours.config.activation == "gelu_tanh"
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    check_roundtrip(ours, tmp_path / "ours")


def test_hidden_activation_wins():
    assert GemmaConfig.from_hf({"model_type": "gemma", "hidden_act": "gelu",
                                "hidden_activation": "gelu_pytorch_tanh"}).activation == "gelu_tanh"
    assert GemmaConfig.from_hf({"model_type": "gemma", "hidden_activation": "silu"}).activation == "silu"


def test_a_bidirectional_checkpoint_is_refused(tmp_path):
    # transformers' Gemma runs such a checkpoint (an embedding model's encoder) attending both ways under SDPA, 0.37
    # of the logits away from a causal run on a tiny model; loaded here it would have run causally without a word.
    hf = build_hf(transformers.GemmaConfig, use_bidirectional_attention=True)
    directory = save_hf(hf, tmp_path / "hf")
    with pytest.raises(ValueError, match="gemma with use_bidirectional_attention=true .* is not a causal LM"):
        AutoLigerForCausalLM.from_pretrained(directory)
    for config in (GemmaConfig, LlamaConfig):  # refused wherever the key appears, not by one family alone
        with pytest.raises(ValueError, match="use_bidirectional_attention=true"):
            config.from_hf({"model_type": config.model_type, "use_bidirectional_attention": True})
    assert GemmaConfig.from_hf({"model_type": "gemma", "use_bidirectional_attention": False}).model_type == "gemma"
