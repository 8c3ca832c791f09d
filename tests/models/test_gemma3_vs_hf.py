"""Gemma 3 text (gemma3_text) vs transformers: (1 + w) q/k norms, the local/global layer pattern with the sequence
past the window, two RoPE tables (local base unscaled, global base with linear scaling), query_pre_attn_scalar,
sandwich norms; v5 nested and v4 flat rope configs, packed documents, cached decoding, the round trip."""

import json

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM, Gemma3TextConfig, LigerGemma3ForCausalLM

from .parity import (build_hf, check_bf16_parity, check_cached_generate, check_packed_documents, check_parity,
                     check_roundtrip, save_hf)

# Pattern 3 over 6 layers: sliding, sliding, full, sliding, sliding, full. qpas 24 ≠ head_dim 32; window 5.
GEMMA3 = dict(head_dim=32, num_hidden_layers=6, sliding_window=5, query_pre_attn_scalar=24,
              sliding_window_pattern=3, max_position_embeddings=64,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 200.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 30.0}})


def build(**overrides):
    hf = build_hf(transformers.Gemma3TextConfig, **{**GEMMA3, **overrides})
    with torch.no_grad():  # sharper attention, so a wrong table, window or norm moves the logits well past 1e-4
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return hf


def v4_style(directory):
    """Rewrite config.json as transformers 4.5x wrote Gemma 3: rope_theta, rope_scaling (the global layers'),
    rope_local_base_freq and sliding_window_pattern, no layer_types."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    full = dict(rope["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    kind = full.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **full}
    cfg.pop("layer_types")
    path.write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize("style", ["v5-nested", "v4-flat"])
def test_parity_qk_norm_two_rope_tables_pattern(tmp_path, style):
    hf = build()
    directory = save_hf(hf, tmp_path / "hf")
    if style == "v4-flat":
        v4_style(directory)
    ours = check_parity(hf, directory, seq_len=17, batch=2)
    assert isinstance(ours, LigerGemma3ForCausalLM)
    assert [layer.self_attn.window for layer in ours.model.layers] == [5, 5, None, 5, 5, None]
    assert ours.model.layer_rope_table == [1, 1, 0, 1, 1, 0]
    assert ours.config.rope_theta == 200.0 and ours.config.rope_local_base_freq == 30.0
    assert ours.config.rope_scaling["rope_type"] == "linear" and ours.config.attention_scale == 24**-0.5
    written = ours.config.to_hf()
    if style == "v5-nested":
        assert written["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 30.0}
        assert "rope_local_base_freq" not in written
    else:
        assert written["rope_local_base_freq"] == 30.0 and written["rope_scaling"]["factor"] == 4.0
    check_roundtrip(ours, tmp_path / "ours", seq_len=12)


def test_rope_tables_and_qk_norms_matter(tmp_path):
    """Swapping the two RoPE tables, or dropping the q/k norms' weights, moves the logits far past the bound: the
    parity above tests both."""
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    ids = torch.randint(3, 128, (1, 16))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ours(ids).logits - ref).abs().max() <= 1e-4
        ours.model.layer_rope_table = [1 - t for t in ours.model.layer_rope_table]
        assert (ours(ids).logits - ref).abs().max() > 1e-2
        ours.model.layer_rope_table = [1 - t for t in ours.model.layer_rope_table]
        for layer in ours.model.layers:
            layer.self_attn.q_norm.weight.zero_()
        assert (ours(ids).logits - ref).abs().max() > 1e-2


def test_final_softcap_and_ignored_attention_softcap(tmp_path):
    # HF's Gemma 3 applies final_logit_softcapping when set and never attn_logit_softcapping.
    hf = build(final_logit_softcapping=0.5, attn_logit_softcapping=0.5)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(6)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=13)
    assert ours.config.logit_softcap == 0.5 and ours.config.attention_softcap is None
    assert all(layer.self_attn.softcap is None for layer in ours.model.layers)


def test_default_pattern_and_unscaled_global_rope(tmp_path):
    # The released 1B shape: pattern 6 by default (layers 5 and 11 global), no rope_scaling, MQA.
    hf = build(num_hidden_layers=7, num_key_value_heads=1, sliding_window_pattern=6,
               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    directory = v4_style(save_hf(hf, tmp_path / "hf"))
    cfg = json.loads((directory / "config.json").read_text())
    del cfg["sliding_window_pattern"]  # HF's default pattern is 6 too
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=12, grads=False)
    assert [layer.self_attn.window is None for layer in ours.model.layers] == [False] * 5 + [True, False]
    assert ours.config.rope_scaling is None


def test_packed_documents_match_separate_hf_runs(tmp_path):
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_packed_documents(hf, ours, (7, 4, 8))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cached_decoding_across_the_window_equals_hf(tmp_path):
    hf = build()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_cached_generate(hf, ours, 6, 9)


def test_config_defaults_and_errors():
    cfg = Gemma3TextConfig.from_hf({"model_type": "gemma3_text", "num_hidden_layers": 12})
    assert [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"] == [5, 11]
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.vocab_size) == (1e6, 1e4, 262208)
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert cfg.layer_rope(0) == (1e4, None) and cfg.layer_rope(5) == (1e6, None)
    with pytest.raises(ValueError, match="expects model_type 'gemma3_text'"):
        Gemma3TextConfig.from_hf({"model_type": "gemma3"})
    with pytest.raises(ValueError, match="never scaled"):
        Gemma3TextConfig.from_hf({"model_type": "gemma3_text", "rope_parameters": {
            "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3TextConfig.from_hf({"model_type": "gemma3_text", "use_bidirectional_attention": True})
    from liger_models import model_class

    assert model_class("gemma3") is LigerGemma3ForCausalLM  # the multimodal checkpoints' decoder
    model = LigerGemma3ForCausalLM.from_config(Gemma3TextConfig.tiny())
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    assert not model.model.layers[0].self_attn.q_norm.weight.detach().any()  # (1 + w): zeros at init


def test_bf16_within_hf_bf16_error(tmp_path):
    """bf16 (the Triton kernels' bf16 paths, the soft-caps in bf16): logits, loss and every gradient within 2× the
    error of HF's own bf16 run, both measured against HF in fp32."""
    hf = build()
    check_bf16_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=13)
