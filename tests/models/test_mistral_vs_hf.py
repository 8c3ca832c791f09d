"""Mistral vs transformers: sliding window shorter than the sequence (exactly W keys), GQA, round trip."""

import transformers

from liger_models import LigerMistralForCausalLM

from .parity import build_hf, check_parity, check_roundtrip, save_hf


def test_sliding_window_shorter_than_sequence(tmp_path):
    hf = build_hf(transformers.MistralConfig, sliding_window=7)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=20)
    assert isinstance(ours, LigerMistralForCausalLM)
    assert all(layer.self_attn.window == 7 for layer in ours.model.layers)
    check_roundtrip(ours, tmp_path / "ours", seq_len=12)


def test_no_window_v4_config(tmp_path):
    hf = build_hf(transformers.MistralConfig, sliding_window=None, head_dim=24)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf", v4_style=True), seq_len=12, grads=False)
    assert ours.config.sliding_window is None and ours.config.head_dim == 24
