"""Mixtral vs transformers: routed experts (top-2 of 4, renormalised, fp32 weights), the auxiliary loss with HF's
coefficient, per-expert and stacked checkpoints, the sliding window, cached decoding, packed documents."""

import json

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM, LigerMixtralForCausalLM, MixtralConfig

from .parity import (build_hf, check_cached_generate, check_packed_documents, check_parity, check_roundtrip, save_hf,
                     stored_names)

MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)


def build_moe(**overrides):
    hf = build_hf(transformers.MixtralConfig, **{**MOE, **overrides})
    hf.set_experts_implementation("eager")  # HF's grouped_mm has no float64 CPU kernel (the parity truth is float64)
    return hf


def test_parity_and_roundtrip(tmp_path):
    hf = build_moe()
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=13)
    assert isinstance(ours, LigerMixtralForCausalLM)
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 96, 64)
    check_roundtrip(ours, tmp_path / "ours")
    names = stored_names(tmp_path / "ours")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in n or ".mlp." in n for n in names)
    assert names == stored_names(tmp_path / "hf")  # exactly what transformers' own save_pretrained writes


def test_stacked_checkpoint_loads(tmp_path):
    hf = build_moe()
    hf.save_pretrained(tmp_path / "stacked", save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored_names(tmp_path / "stacked")
    ours = AutoLigerForCausalLM.from_pretrained(tmp_path / "stacked", dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_load_state_dict_takes_per_expert_and_stackedstored_names():
    config = MixtralConfig.tiny()
    a, b = LigerMixtralForCausalLM.from_config(config), LigerMixtralForCausalLM.from_config(config)
    b.load_state_dict(a.state_dict(), strict=True)
    assert torch.equal(a.model.layers[1].mlp.experts.down_proj, b.model.layers[1].mlp.experts.down_proj)
    stacked = {n: p.detach().clone() for n, p in a.named_parameters()}
    c = LigerMixtralForCausalLM.from_config(config)
    c.load_state_dict(stacked, strict=True)
    assert torch.equal(a.model.layers[0].mlp.experts.gate_up_proj, c.model.layers[0].mlp.experts.gate_up_proj)
    missing = a.state_dict()
    del missing["model.layers.0.block_sparse_moe.experts.1.w3.weight"]
    with pytest.raises(RuntimeError, match="experts.gate_up_proj"):
        c.load_state_dict(missing, strict=True)


def test_load_state_dict_of_a_transformers_model(tmp_path):
    # transformers v5 modules hold the experts stacked under mlp. (not block_sparse_moe.): load_state_dict takes it.
    hf = build_moe()
    ours = LigerMixtralForCausalLM.from_config(MixtralConfig.from_hf(hf.config.to_dict()))
    ours.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(3, 128, (1, 8))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("padded", [False, True])
def test_aux_loss_and_loss_equal_hf(tmp_path, padded):
    hf = build_moe(router_aux_loss_coef=0.02)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    ids = torch.randint(3, 128, (2, 10))
    labels = ids.clone()
    mask = torch.ones_like(ids)
    if padded:  # right padding: the mask hides keys and the aux loss skips those rows; labels ignore them
        mask[1, 7:] = 0
        labels[1, 7:] = -100
    ref = hf(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    out = ours(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (20, 4)
    real = mask.reshape(-1).bool()  # a padded query row attends differently (modules/attention.py): not compared
    for mine, theirs in zip(out.router_logits, ref.router_logits):
        assert (mine - theirs)[real].abs().max().item() <= 1e-5
    assert abs(out.aux_loss.item() - ref.aux_loss.item()) <= 1e-5
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5
    without = ours(ids, attention_mask=mask, labels=labels)
    assert without.aux_loss is None and abs(out.loss.item() - without.loss.item() - 0.02 * out.aux_loss.item()) < 1e-5
    # The aux term reaches the router's gradient.
    out.loss.backward()
    assert ours.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_config_output_router_logits_and_tuple_output(tmp_path):
    hf = build_moe(output_router_logits=True)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    ids = torch.randint(3, 128, (1, 6))
    out = ours(ids, labels=ids, return_dict=False)
    assert len(out) == 3  # loss, aux_loss, router_logits (logits are not formed with labels)
    assert ours(ids, output_router_logits=False).aux_loss is None


def test_sliding_window_every_layer(tmp_path):
    hf = build_moe(sliding_window=4)
    ours = check_parity(hf, save_hf(hf, tmp_path / "hf"), seq_len=11)
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, 4]


def test_v4_config_defaults(tmp_path):
    hf = build_moe()
    directory = save_hf(hf, tmp_path / "hf", v4_style=True)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")  # HF's attribute_map alias
    (directory / "config.json").write_text(json.dumps(cfg))
    ours = check_parity(hf, directory, seq_len=8, grads=False)
    assert ours.config.num_local_experts == 4
    default = MixtralConfig.from_hf({"model_type": "mixtral"})
    assert default.rope_theta == 1e6 and default.rms_norm_eps == 1e-5 and default.num_experts_per_tok == 2


def test_packed_documents_match_separate_hf_runs(tmp_path):
    hf = build_moe()
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_packed_documents(hf, ours, (4, 7, 2))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_cached_generate_equals_hf(tmp_path):
    hf = build_moe(sliding_window=5)
    ours = AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "hf"), dtype=torch.float32)
    check_cached_generate(hf, ours, 6, 7, every_step=False)


def test_jitter_only_in_training():
    config = MixtralConfig.tiny(router_jitter_noise=0.5)
    model = LigerMixtralForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits)


def test_bad_expert_counts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_experts_per_tok must be at most num_local_experts"):
        MixtralConfig.tiny(num_local_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="num_local_experts must be a positive integer"):
        MixtralConfig.tiny(num_local_experts=0)
    # A checkpoint missing one expert's tensor names it.
    model = LigerMixtralForCausalLM.from_config(MixtralConfig.tiny())
    model.save_pretrained(tmp_path / "ckpt")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="experts.2.w3.weight"):
        AutoLigerForCausalLM.from_pretrained(tmp_path / "ckpt")
