"""Qwen3 vs transformers: per-head q/k RMSNorm before RoPE, head_dim ≠ hidden / heads, attention_bias on q/k/v/o,
tied and untied heads, use_sliding_window / max_window_layers / layer_types, cached decoding, packed documents."""


import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM, LigerQwen3ForCausalLM, Qwen3Config

from .parity import build_hf, check_cached_generate, check_packed_documents, check_parity, check_roundtrip, save_hf


def test_qk_norm_head_dim_tied(tmp_path):
    # head_dim 24 with hidden 64 and 4 heads (q_proj is 96 × 64); q/k norm weights perturbed by build_hf.
    hf = build_hf(transformers.Qwen3Config, head_dim=24, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=16)
    assert isinstance(ours, LigerQwen3ForCausalLM)
    attn = ours.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (96, 64) and attn.q_norm.weight.shape == (24,)
    assert attn.q_proj.bias is None and attn.o_proj.bias is None
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, None]
    check_roundtrip(ours, tmp_path / "ours")


def test_qk_norm_matters(tmp_path):
    # The q/k norms must be applied: zeroing the norm's effect (weights of 1, inputs already unit-RMS would not do)
    # is checked by scaling a q_norm weight and seeing the logits move, both in HF and ours, by the same amount.
    hf = build_hf(transformers.Qwen3Config, head_dim=16)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    ids = torch.randint(3, 128, (1, 12))
    with torch.no_grad():
        before = ours(ids).logits
        for model in (hf, ours):
            model.model.layers[0].self_attn.k_norm.weight.mul_(3.0)
        after, ref = ours(ids).logits, hf(ids).logits
    assert (after - before).abs().max() > 1e-3
    assert (after - ref).abs().max() <= 1e-4


def test_attention_bias_untied_v4_config(tmp_path):
    hf = build_hf(transformers.Qwen3Config, head_dim=16, attention_bias=True, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_(std=0.3)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf", v4_style=True), seq_len=12)
    assert ours.model.layers[1].self_attn.o_proj.bias is not None
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    check_roundtrip(ours, tmp_path / "ours")


def test_sliding_window_upper_layers_past_the_window(tmp_path):
    # use_sliding_window with max_window_layers 1: layer 1 slides (W = 5), layer 0 is full; T = 14 > W.
    hf = build_hf(transformers.Qwen3Config, head_dim=16, use_sliding_window=True, sliding_window=5,
                  max_window_layers=1)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=14)
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, 5]


def test_window_flag_off_ignores_the_window(tmp_path):
    hf = build_hf(transformers.Qwen3Config, head_dim=16, use_sliding_window=False, sliding_window=3)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=10, grads=False)
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, None]


def test_explicit_layer_types(tmp_path):
    hf = build_hf(transformers.Qwen3Config, head_dim=16, use_sliding_window=True, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention"])
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=11, grads=False)
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, None]


def test_packed_documents_match_separate_hf_runs(tmp_path):
    hf = build_hf(transformers.Qwen3Config, head_dim=16)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_packed_documents(hf, ours, (5, 7, 3))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cached_decoding_across_the_window_equals_hf(tmp_path):
    hf = build_hf(transformers.Qwen3Config, head_dim=16, use_sliding_window=True, sliding_window=4,
                  max_window_layers=1)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_cached_generate(hf, ours, 6, 8)


def test_config_defaults_and_tiny():
    cfg = Qwen3Config.from_hf({"model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 32,
                               "num_hidden_layers": 2})
    assert cfg.head_dim == 128 and cfg.num_key_value_heads == 32 and not cfg.attention_bias
    assert Qwen3Config.tiny().head_dim == 16
    model = LigerQwen3ForCausalLM.from_config(Qwen3Config.tiny())
    assert model.model.layers[0].self_attn.k_norm.weight.shape == (16,)
