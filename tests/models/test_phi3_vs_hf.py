"""Phi3 vs transformers: fused qkv_proj / gate_up_proj, longrope on both sides of the switch ("su" alias), window."""

import json

import pytest
import torch
import transformers

from liger_models import LigerPhi3ForCausalLM, Phi3Config

from .parity import build_hf, check_parity, check_roundtrip, save_hf

ORIGINAL = 12


def longrope_hf():
    half = 64 // 4 // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": torch.linspace(1.0, 1.5, half).tolist(),
            "long_factor": torch.linspace(1.0, 6.0, half).tolist()}
    return build_hf(transformers.Phi3Config, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
                    rope_parameters=rope, sliding_window=9, pad_token_id=0)


@pytest.mark.parametrize("seq_len", [ORIGINAL - 2, ORIGINAL + 8], ids=["short-factors", "long-factors"])
def test_longrope_both_sides(tmp_path, seq_len):
    hf = longrope_hf()
    directory = save_hf(hf, tmp_path / "hf", v4_style=True)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_scaling"]["type"] = "su"  # the original Phi-3-mini-128k spelling
    cfg["rope_scaling"].pop("original_max_position_embeddings", None)  # top-level key only, as Microsoft ships it
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=seq_len)
    assert isinstance(ours, LigerPhi3ForCausalLM) and ours.config.rope_scaling["rope_type"] == "longrope"
    factor = ours.model.rotary.attention_factor
    assert abs(factor - (1 + torch.log(torch.tensor(64 / ORIGINAL)) / torch.log(torch.tensor(ORIGINAL))).sqrt()) < 1e-6


def test_fused_tensors_roundtrip(tmp_path):
    hf = build_hf(transformers.Phi3Config, pad_token_id=0)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=10, grads=False)
    names = set(ours.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    check_roundtrip(ours, tmp_path / "ours")


def test_top_level_original_max_wins():
    cfg = Phi3Config.from_hf({"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
                              "original_max_position_embeddings": 8, "rope_scaling": {
                                  "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 99}})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 8


@pytest.mark.parametrize("v4_style", [False, True], ids=["v5-config", "v4-config"])
def test_partial_rotary_factor(tmp_path, v4_style):
    hf = build_hf(transformers.Phi3Config, partial_rotary_factor=0.5, pad_token_id=0)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf", v4_style=v4_style), seq_len=12, grads=False)
    assert ours.config.rotary_dim == ours.config.head_dim // 2
    ours.save_pretrained(tmp_path / "ours")  # every key of the original config.json is written back
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert set(original) <= set(saved), f"keys dropped: {set(original) - set(saved)}"
    assert saved["partial_rotary_factor"] == original["partial_rotary_factor"] == 0.5


def test_v4_rope_scaling_is_written_back_as_it_came(tmp_path):
    # transformers 4.x's Phi3Config rejects a rope_scaling that is not exactly {type, short_factor, long_factor}
    # (Phi-3.5-mini's config.json shape); a checkpoint we save must stay loadable there.
    hf = longrope_hf()
    directory = save_hf(hf, tmp_path / "hf", v4_style=True)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_scaling"] = {k: cfg["rope_scaling"][k] for k in ("type", "short_factor", "long_factor")}
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=ORIGINAL + 4, grads=False)
    check_roundtrip(ours, tmp_path / "ours", seq_len=ORIGINAL + 4)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["rope_scaling"] == cfg["rope_scaling"]
