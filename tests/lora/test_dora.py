"""DoRA (weight-decomposed LoRA, PEFT's ``use_dora``) in the fused LoRA paths, against HF + PEFT's own DoRA computed
in float64: logits, loss and the gradients of every A, B and magnitude, for each kind of fused group (q|k|v behind the
norm, gate|up, gated → down, Phi3's packed projections, q/k/v biases); the dropout path against DoRA's definition;
adapters both ways in PEFT's format; merge, unmerge and the merged export; an NF4 base."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers

from liger_models.lora import (LoraSettings, load_adapter, lora_modules, merge_lora, quantize_base_, read_adapter,
                               save_adapter, save_merged, unmerge_lora)
from liger_models.modules.lora_linear import LoraLinear, dora_row_norms

from ..models.parity import float64_reference, max_rel
from .common import (assert_as_close_as_fp32_allows, assert_matches_float64_peft, assert_unmerged_exactly, batch,
                     pair, peft_float64, ulp_moved_logits, with_adapters)

peft = pytest.importorskip("peft")


def _dora(model, family: str, target_set: str = "all-linear"):
    """Random adapters with DoRA, magnitudes moved off the row norms (so m / n is not 1 and scales every row)."""
    with_adapters(model, family, target_set, use_dora=True)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_magnitude_vector.mul_(torch.empty_like(m.lora_magnitude_vector).uniform_(0.5, 1.5))
    return model


def _random_biases(hf, ours) -> None:
    """Qwen2's q/k/v biases drawn on both sides (HF initialises them to zero, which would hide where the bias goes)."""
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.5)
                ours.get_submodule(name).bias.copy_(module.bias)


def _check_against_peft(ours, truth, *, magnitudes: int):
    grads = assert_matches_float64_peft(ours, truth)
    assert sum(n.endswith(".lora_magnitude_vector") for n in grads) == magnitudes


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3", "qwen3"])
def test_dora_matches_float64_hf_peft(family, tmp_path):
    hf, ours, _ = pair(family, tmp_path)
    _random_biases(hf, ours)
    _dora(ours, family)
    truth = peft_float64(hf, ours, tmp_path)
    _check_against_peft(ours, truth, magnitudes=len(lora_modules(ours)))


def test_dora_on_some_siblings_only(tmp_path):
    # q and v adapted (k plain) in the q|k|v group: the scaled rows are the adapted ones only.
    hf, ours, _ = pair("llama", tmp_path)
    _dora(ours, "llama", "attention")
    for name in [n for n in lora_modules(ours) if n.endswith(("k_proj", "o_proj"))]:
        parent, _, leaf = name.rpartition(".")
        m = ours.get_submodule(name)
        plain = torch.nn.Linear(m.in_features, m.out_features, bias=False)
        plain.weight = m.weight
        setattr(ours.get_submodule(parent), leaf, plain)
    ours.lora_settings = LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj"], use_dora=True)
    ours.pack_()
    truth = peft_float64(hf, ours, tmp_path)
    _check_against_peft(ours, truth, magnitudes=4)


def test_row_norms_without_the_whole_matrix():
    w = torch.randn(2500, 40, dtype=torch.float64)  # more rows than one block
    a, b = torch.randn(3, 40, dtype=torch.float64), torch.randn(2500, 3, dtype=torch.float64)
    exact = torch.linalg.vector_norm(w + 0.7 * b @ a, dim=1)
    got = dora_row_norms(w.float(), a.float(), b.float(), 0.7)
    assert got.dtype == torch.float32 and max_rel(got.double(), exact) < 1e-6


def test_dropout_follows_doras_definition():
    # Training with dropout: y = W·x + b + (m/n − 1)·W·drop(x) + (m/n)·s·B·A·drop(x) (PEFT's DoRA),
    # n from W + s·B·A.
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 20)
    lin = LoraLinear.from_linear(base)
    for p in lin.parameters():
        p.requires_grad_(False)
    lin.add_adapter(4, 8.0, dropout=0.3, init=False, use_dora=True)
    with torch.no_grad():
        lin.lora_magnitude_vector.mul_(torch.empty(20).uniform_(0.5, 1.5))
    lin.train()
    x = torch.randn(5, 7, 24)
    torch.manual_seed(1)
    y = lin(x)
    torch.manual_seed(1)
    dropped = torch.nn.functional.dropout(x.double(), 0.3, True)
    w, bias = base.weight.double(), base.bias.double()
    a, b, m = (t.detach().double() for t in (lin.lora_A.weight, lin.lora_B.weight, lin.lora_magnitude_vector))
    factor = m / torch.linalg.vector_norm(w + 2.0 * b @ a, dim=1)
    exact = x.double() @ w.T + bias + (factor - 1) * (dropped @ w.T) + factor * 2.0 * (dropped @ a.T @ b.T)
    assert max_rel(y.double(), exact) < 1e-6
    assert torch.count_nonzero(dropped == 0) > 0  # the mask was drawn
    y.sum().backward()
    assert all(p.grad is not None for p in (lin.lora_A.weight, lin.lora_B.weight, lin.lora_magnitude_vector))


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_hf_peft_dora_adapter_loads_here_with_the_same_logits(family, tmp_path):
    hf, ours, _ = pair(family, tmp_path)
    names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if family == "phi3" else \
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=names,
                                                      init_lora_weights=False, use_dora=True))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
    trained.save_pretrained(tmp_path / "hf_adapter")
    settings, tensors = read_adapter(tmp_path / "hf_adapter")
    assert settings.use_dora and any(k.endswith(".lora_magnitude_vector") for k in tensors)
    load_adapter(ours, tmp_path / "hf_adapter")
    assert all(m.use_dora for m in lora_modules(ours).values())
    ids, _ = batch()
    with torch.no_grad():
        exact = peft_float64(clean, ours, tmp_path / "float64").eval()(input_ids=ids.clone()).logits
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, trained.eval()(input_ids=ids).logits, exact,
                                       redraw=ulp_moved_logits(ours, ids))


def test_our_dora_adapter_is_peft_format(tmp_path):
    _, ours, _ = pair("qwen2", tmp_path)
    _dora(ours, "qwen2", "mlp")
    save_adapter(ours, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_dora"] is True
    _, tensors = read_adapter(tmp_path / "adapter")
    for name, m in lora_modules(ours).items():
        assert torch.equal(tensors[f"{name}.lora_magnitude_vector"], m.lora_magnitude_vector)


def test_merge_unmerge_and_merged_export(tmp_path):
    hf, ours, _ = pair("qwen2", tmp_path)  # q/k/v biases: the bias stays outside the DoRA scaling
    _random_biases(hf, ours)
    _dora(ours, "qwen2")
    ids, _ = batch()
    ours.eval()
    with torch.no_grad():
        truth = peft_float64(hf, ours, tmp_path / "float64").eval()
        exact = truth(input_ids=ids).logits
        adapted = ours(ids).logits
        # A merged fp32 weight is one more rounding of W + s·B·A scaled by m / ‖·‖: no closer than HF + PEFT's own
        # fp32 merge of the same adapters gets (one CI seed: 1.06e-5 theirs, 1.05e-5 ours, against 3.8e-6 unmerged).
        peer_merged = truth.fp32_peer().eval().merge_and_unload()(input_ids=ids).logits
        bound = max(2 * max_rel(adapted.double(), exact), 2 * max_rel(peer_merged.double(), exact), 1e-5)
        q = lora_modules(ours)["model.layers.0.self_attn.q_proj"]
        base_q = q.weight.clone()
        merge_lora(ours)
        assert not torch.equal(q.weight, base_q)
        assert max_rel(ours(ids).logits.double(), exact) <= bound
        unmerge_lora(ours)
        assert max_rel(ours(ids).logits.double(), exact) <= bound
        assert_unmerged_exactly(q, base_q)
    save_merged(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():  # the export's weights, computing in float64 (parity.float64_reference)
        assert max_rel(float64_reference(merged)(input_ids=ids).logits, exact) <= bound


def test_nf4_base_with_dora_matches_float64_reference(tmp_path):
    # The magnitudes start at the row norms of the dequantised W (quantised before the adapters, as PEFT's QLoRA).
    hf, ours, _ = pair("llama", tmp_path)
    quantize_base_(ours)
    with_adapters(ours, "llama", "all-linear", use_dora=True, init=True)
    q = lora_modules(ours)["model.layers.0.self_attn.q_proj"]
    assert torch.allclose(q.lora_magnitude_vector, torch.linalg.vector_norm(q.base_weight(torch.float32), dim=1))
    with torch.no_grad():
        for m in lora_modules(ours).values():
            torch.nn.init.normal_(m.lora_B.weight, std=1 / math.sqrt(m.r))
            m.lora_magnitude_vector.mul_(torch.empty_like(m.lora_magnitude_vector).uniform_(0.5, 1.5))
    dequantised = copy.deepcopy(hf)
    with torch.no_grad():
        for name, m in lora_modules(ours).items():
            dequantised.get_submodule(name).weight.copy_(m.base_weight(torch.float32))
    truth = peft_float64(dequantised, ours, tmp_path)
    _check_against_peft(ours, truth, magnitudes=len(lora_modules(ours)))


def test_mismatched_dora_files_are_refused(tmp_path):
    _, ours, _ = pair("llama", tmp_path)
    _dora(ours, "llama", "attention")
    save_adapter(ours, tmp_path / "adapter")
    cfg_path = tmp_path / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["use_dora"] = False
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="DoRA magnitude, but adapter_config.json does not set use_dora"):
        read_adapter(tmp_path / "adapter")

    _, plain, _ = pair("llama", tmp_path / "plain")
    with_adapters(plain, "llama", "attention")
    save_adapter(plain, tmp_path / "no_magnitudes")
    cfg_path = tmp_path / "no_magnitudes" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["use_dora"] = True
    cfg_path.write_text(json.dumps(cfg))
    _, fresh, _ = pair("llama", tmp_path / "fresh")
    with pytest.raises(ValueError, match=r"lora_magnitude_vector \(DoRA\) needs shape"):
        load_adapter(fresh, tmp_path / "no_magnitudes")


def test_dora_on_nf4_dequantises_each_weight_once_per_backward(tmp_path, monkeypatch):
    """DoRA on an NF4 base needs the base weight in backward twice (dX and dm): it is dequantised once for both.
    One training step: each NF4 weight is dequantised once in forward and once in backward."""
    from liger_models.modules.lora_linear import NF4Weight

    _, ours, _ = pair("llama", tmp_path)
    quantize_base_(ours)
    with_adapters(ours, "llama", use_dora=True)
    calls = []
    real = NF4Weight.dequantize
    monkeypatch.setattr(NF4Weight, "dequantize", lambda self, dtype=None: calls.append(id(self)) or real(self, dtype))
    ours.train()
    ids, labels = batch()
    ours(ids, labels=labels).loss.backward()
    counts = {q: calls.count(q) for q in set(calls)}
    assert len(counts) == 2 * 7 and set(counts.values()) == {2}, sorted(counts.values())
