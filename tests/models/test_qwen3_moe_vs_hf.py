"""Qwen3-MoE vs transformers: q/k norm with head_dim ≠ hidden / heads, norm_topk_prob both ways, mlp_only_layers and
decoder_sparse_step (dense layers between sparse ones), the auxiliary loss, num_experts / num_local_experts, per-expert
and stacked checkpoints, the window on every layer, cached decoding, packed documents."""

import json

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM, LigerQwen3MoeForCausalLM, Qwen3MoeConfig

from .parity import (build_hf, check_cached_generate, check_packed_documents, check_parity, check_roundtrip, save_hf,
                     stored_names)

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=24)


def build_moe(**overrides):
    hf = build_hf(transformers.Qwen3MoeConfig, **{**MOE, **overrides})
    hf.set_experts_implementation("eager")  # HF's grouped_mm has no float64 CPU kernel (the parity truth is float64)
    return hf


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_parity_dense_and_sparse_layers(tmp_path, norm_topk_prob):
    # Layer 0 dense (mlp_only_layers), layers 1 and 2 sparse.
    hf = build_moe(norm_topk_prob=norm_topk_prob, mlp_only_layers=[0], num_hidden_layers=3)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=13)
    assert isinstance(ours, LigerQwen3MoeForCausalLM)
    assert [layer.sparse for layer in ours.model.layers] == [False, True, True]
    assert ours.model.layers[1].self_attn.q_norm.weight.shape == (24,)
    assert ours.config.norm_topk_prob is norm_topk_prob


def test_roundtrip_names_and_config_keys(tmp_path):
    hf = build_moe(decoder_sparse_step=2, intermediate_size=40)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    assert [layer.sparse for layer in ours.model.layers] == [False, True]
    assert ours.model.layers[0].mlp.gate_proj.weight.shape == (40, 64)
    check_roundtrip(ours, tmp_path / "ours", max_shard_size="40KB")
    assert stored_names(tmp_path / "ours") == stored_names(tmp_path / "hf")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in stored_names(tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["num_experts"] == cfg["num_local_experts"] == 4 and cfg["head_dim"] == 24


def test_stacked_checkpoint_and_v4_config(tmp_path):
    hf = build_moe(norm_topk_prob=True)
    directory = tmp_path / "stacked"
    hf.save_pretrained(directory, save_original_format=False)
    assert "model.layers.1.mlp.experts.down_proj" in stored_names(directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")  # the Hub's (v4) key
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=9, grads=False)
    assert ours.config.num_experts == 4


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_aux_loss_and_loss_equal_hf(tmp_path, norm_topk_prob):
    hf = build_moe(norm_topk_prob=norm_topk_prob, router_aux_loss_coef=0.01)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ref = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out = ours(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    real = mask.reshape(-1).bool()  # a padded query row attends differently (modules/attention.py): not compared
    for mine, theirs in zip(out.router_logits, ref.router_logits, strict=True):
        assert (mine - theirs)[real].abs().max().item() <= 1e-5
    assert abs(out.aux_loss.item() - ref.aux_loss.item()) <= 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5


def test_all_layers_dense_gives_zero_aux_loss():
    model = LigerQwen3MoeForCausalLM.from_config(Qwen3MoeConfig.tiny(mlp_only_layers=[0, 1]))
    ids = torch.randint(3, 128, (1, 5))
    out = model(ids, labels=ids, output_router_logits=True)
    assert out.router_logits == () and out.aux_loss.item() == 0.0


def test_sliding_window_every_layer(tmp_path):
    hf = build_moe(use_sliding_window=True, sliding_window=4)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=11, grads=False)
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, 4]


def test_packed_documents_match_separate_hf_runs(tmp_path):
    hf = build_moe()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_packed_documents(hf, ours, (3, 6, 5))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cached_generate_equals_hf(tmp_path):
    hf = build_moe(norm_topk_prob=True)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_cached_generate(hf, ours, 5, 7, every_step=False)


def test_config_defaults_and_errors():
    cfg = Qwen3MoeConfig.from_hf({"model_type": "qwen3_moe", "num_local_experts": 16})
    assert cfg.num_experts == 16 and cfg.head_dim == 2048 // 32 and cfg.norm_topk_prob is False
    assert cfg.num_experts_per_tok == 8 and cfg.router_aux_loss_coef == 0.001
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeConfig.tiny(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        Qwen3MoeConfig.tiny(decoder_sparse_step=0)
