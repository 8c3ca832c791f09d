"""Native LoRA (fused into the packed projections) against HF + PEFT computed in float64 (unpacked W + s·B·A):
logits, loss, every adapter's gradient and the input gradient, for every family and target set."""

from __future__ import annotations

import pytest
import torch

from liger_models.lora import lora_modules

from .common import BASE_FAMILIES, CONFIGS, TARGET_SETS, assert_matches_float64_peft, pair, peft_float64, with_adapters

pytest.importorskip("peft")


def _check(family, target_set, tmp_path, **lora_kw):
    hf, ours, _ = pair(family, tmp_path)
    with_adapters(ours, family, target_set, **lora_kw)
    truth = peft_float64(hf, ours, tmp_path)
    # The embedding table trains too, on both sides: its gradient is the gradient of every layer's input.
    ours.model.embed_tokens.weight.requires_grad_(True)
    truth.base_model.model.model.embed_tokens.weight.requires_grad_(True)
    grads = assert_matches_float64_peft(ours, truth)
    adapted = lora_modules(ours)
    assert adapted and len(grads) == 2 * len(adapted) + 1


@pytest.mark.parametrize("target_set", sorted(TARGET_SETS))
@pytest.mark.parametrize("family", BASE_FAMILIES)
def test_lora_matches_float64_reference(family, target_set, tmp_path):
    _check(family, target_set, tmp_path)


@pytest.mark.parametrize("family", sorted(set(CONFIGS) - set(BASE_FAMILIES)))
def test_lora_on_newer_families_matches_float64_reference(family, tmp_path):
    _check(family, "all-linear", tmp_path)


@pytest.mark.parametrize("relative", [1e-3, 3e-4])
def test_the_float64_check_fails_a_slightly_wrong_adapter(tmp_path, relative):
    """The harness itself: past its fixed bounds it weighs ours against HF + PEFT in fp32 and ulp-moved copies of
    ours (common.assert_matches_float64_peft); an adapter of ours off by ``relative`` from the one the float64
    reference loaded must fail it all the same (Gemma 3: the family whose fp32 errors spread widest)."""
    hf, ours, _ = pair("gemma3", tmp_path)
    with_adapters(ours, "gemma3", "all-linear")
    truth = peft_float64(hf, ours, tmp_path)
    with torch.no_grad():
        ours.get_parameter(next(n for n, _ in ours.named_parameters() if "lora_B" in n)).mul_(1 + relative)
    with pytest.raises(AssertionError, match="off float64"):
        assert_matches_float64_peft(ours, truth)


def test_some_siblings_adapted_rsLoRA_and_rank_pattern(tmp_path):
    """q and v adapted, k plain inside the packed q|k|v GEMM; a per-module rank; rsLoRA scaling."""
    _check("llama", "all-linear", tmp_path, targets=["q_proj", "v_proj", "up_proj"], use_rslora=True,
           rank_pattern={"v_proj": 2}, alpha_pattern={"up_proj": 3.0})


@pytest.mark.parametrize("config_name", ["MixtralConfig", "Qwen3MoeConfig"])
def test_moe_families_all_linear_targets(config_name):
    """all-linear on a mixture-of-experts model: the attention projections, each router and each block's expert
    stacks (tests/lora/test_moe_experts.py checks the numbers); the adapters train, nothing else does."""
    import liger_models
    from liger_models.auto import model_class
    from liger_models.lora import LoraSettings, add_lora

    config = getattr(liger_models, config_name).tiny()
    model = model_class(config.model_type).from_config(config)
    names = add_lora(model, LoraSettings(r=4, alpha=8, init=False))
    assert {n.rsplit(".", 1)[1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts"}
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 12))
    model(ids, labels=ids).loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    experts = [n for n in names if n.endswith("experts")]
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * (len(names) - len(experts)) + 4 * len(experts)  # A and B per adapter, 2 per stack


@pytest.mark.parametrize("rows", [1, 5, 26])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_on_the_cpu_adapted_siblings_round_as_peft_does(family, rows, tmp_path):
    """On the CPU the fused q|k|v group's fp32 output is each linear's plain-op path (PEFT's order, one x·Aᵀ per
    adapter) bit for bit: torch's CPU GEMM rounds one product of 3·r columns worse than three of r, and that had put
    ours up to 6x HF + PEFT's fp32 error on a tiny Gemma 3 with large adapters."""
    from liger_models.modules.lora_linear import lora_packed_linear

    _, ours, _ = pair(family, tmp_path)
    with_adapters(ours, family, "all-linear")
    attn = ours.model.layers[0].self_attn
    siblings = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(rows, ours.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(lora_packed_linear(x, siblings), torch.cat([s.composed(x) for s in siblings], dim=-1))
