"""Qwen2 vs transformers: q/k/v biases, tied head (≤3B style), use_sliding_window / max_window_layers."""

import math

import transformers

from liger_models import LigerQwen2ForCausalLM

from .parity import build_hf, check_parity, check_roundtrip, save_hf


def test_qkv_bias_tied_window_flag_off(tmp_path):
    # sliding_window is set but use_sliding_window is false: full causal attention everywhere (Qwen2.5 ships this).
    hf = build_hf(transformers.Qwen2Config, tie_word_embeddings=True, sliding_window=5, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    with __import__("torch").no_grad():
        # HF inits biases to zero; make them matter. At std 0.5 they outweigh the projections (~0.16), so a bias
        # dropped or misplaced in the fused QKV moves the outputs far past any bound. At std 1 the attention is so
        # ill-conditioned that one ulp of the embeddings moves the float32 error of layer 1's q/k gradients 3×
        # either way (measured, for HF and ours alike): float32 rounding luck, not the code, then failed ~2% of seeds.
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(std=0.5)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=16)
    assert isinstance(ours, LigerQwen2ForCausalLM)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert ours.model.layers[0].self_attn.q_proj.bias is not None and ours.model.layers[0].self_attn.o_proj.bias is None
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, None]
    check_roundtrip(ours, tmp_path / "ours")


def test_sliding_window_upper_layers(tmp_path):
    hf = build_hf(transformers.Qwen2Config, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf", v4_style=True), seq_len=18)
    assert [layer.self_attn.window for layer in ours.model.layers] == [None, 6]


def test_yarn_rope_v4_config(tmp_path):
    # Qwen2.5's documented long-context recipe adds {"type": "yarn", "factor": 4, "original_max_position_embeddings":
    # 32768} to config.json (docs/models.md#qwen2); positions past the original length must rotate as HF's do.
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 1000000.0}
    hf = build_hf(transformers.Qwen2Config, max_position_embeddings=32, rope_parameters=rope)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf", v4_style=True), seq_len=20)
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    assert abs(ours.model.rotary.attention_factor - (0.1 * math.log(4.0) + 1)) < 1e-12
