"""LoRA on mixture-of-experts models (Mixtral, Qwen3-MoE): adapters on the stacked experts and the routers, in
PEFT's target_parameters layout, against float64 HF + PEFT; the grouped GEMMs against a per-expert loop; PEFT files
both ways; merge and merged export; all-linear's choice of targets."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.lora import (LoraSettings, add_lora, load_adapter, lora_state_dict, merge_lora, save_adapter,
                               save_merged, unmerge_lora)
from liger_models.modules.moe import ExpertsLora, experts_forward

from ..models.parity import build_hf, float64_reference, max_rel, save_hf
from .common import assert_as_close_as_fp32_allows, assert_matches_float64_peft, batch, ulp_moved_logits

FAMILIES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=16, moe_intermediate_size=32, num_experts=4,
                                                    num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _pair(family: str, tmp_path):
    """(HF fp32 with its per-expert loop (float64 has no grouped_mm CPU kernel), ours fp32, checkpoint dir)."""
    config, overrides = FAMILIES[family]
    hf = build_hf(config, **overrides)
    hf.set_experts_implementation("eager")
    directory = save_hf(hf, tmp_path / family)
    return hf, AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32), directory


def _peft_names(ours) -> dict[str, str]:
    """Our trained parameter name → HF + PEFT's in-memory name of the same tensor (adapter "default")."""
    key_of = {id(p): key for key, p in lora_state_dict(ours).items()}
    out = {}
    for name, p in ours.named_parameters():
        if id(p) in key_of:
            key = key_of[id(p)]
            for part in ("lora_A", "lora_B"):
                key = key.replace(f".{part}.weight", f".{part}.default.weight")
            out[name] = "base_model.model." + key
    return out


def _assert_step_matches(ours, truth) -> None:
    """One training step equals float64 HF + PEFT's (common.assert_matches_float64_peft), and what trains is the
    adapters, each with a gradient that is not zero."""
    names = _peft_names(ours)
    grads = assert_matches_float64_peft(ours, truth, names)
    assert grads and set(grads) == set(names)
    assert all(g.abs().max() > 0 for g in grads.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_all_linear_matches_float64_peft(family, tmp_path):
    """all-linear: attention, routers and both expert stacks adapted (gate|up at 2r, as HF + PEFT's all-linear);
    our saved adapter, loaded by PEFT's own loader into float64 HF, gives the same step."""
    hf, ours, _ = _pair(family, tmp_path)
    names = add_lora(ours, LoraSettings(r=4, alpha=8, init=False))
    assert {n.split(".", 3)[-1] for n in names} >= {"self_attn.q_proj", "mlp.gate", "mlp.experts"}
    experts = ours.model.layers[0].mlp.experts
    assert experts.lora["gate_up_proj"].r == 8 and experts.lora["down_proj"].r == 4
    assert experts.lora["gate_up_proj"].scaling == experts.lora["down_proj"].scaling == 2.0
    save_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["down_proj", "gate.weight", "gate_up_proj"]
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    truth = peft.PeftModel.from_pretrained(float64_reference(hf), tmp_path / "adapter", is_trainable=True).double()
    _assert_step_matches(ours, truth)


@pytest.mark.parametrize("stacks", [["gate_up_proj"], ["down_proj"], ["gate.weight", "experts.down_proj"]])
def test_some_parameters_match_float64_peft(stacks, tmp_path):
    """One stack alone (PEFT then names its wrapper without base_layer), or a router and one stack; rsLoRA."""
    hf, ours, _ = _pair("qwen3_moe", tmp_path)
    add_lora(ours, LoraSettings(r=3, alpha=5, init=False, targets=["q_proj"], target_parameters=stacks,
                                use_rslora=True))
    save_adapter(ours, tmp_path / "adapter")
    truth = peft.PeftModel.from_pretrained(float64_reference(hf), tmp_path / "adapter", is_trainable=True).double()
    _assert_step_matches(ours, truth)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_adapter_trained_on_hf_loads_here(family, tmp_path):
    """HF + PEFT's own all-linear adapter on a MoE model (its v5 target_parameters form): the same logits here."""
    hf, ours, _ = _pair(family, tmp_path)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     init_lora_weights=False))
    theirs.save_pretrained(tmp_path / "theirs")
    names = load_adapter(ours, tmp_path / "theirs")
    assert any(n.endswith("mlp.experts") for n in names) and any(n.endswith("mlp.gate") for n in names)
    ids, _ = batch()
    with torch.no_grad():
        expected = theirs.eval()(input_ids=ids, use_cache=False).logits
        got = ours.eval()(ids).logits
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("path", ["padded", "grouped_mm"])
def test_grouped_gemms_equal_a_per_expert_loop(path):
    """experts_forward (fp32) with adapters on both stacks against W_e + s·B_e·A_e applied per expert and per slot
    in float64: output and every gradient (x, routing weights, experts' weights, the four factors), an expert with
    no tokens (its factors get zero gradient) and two tokens on the same pair included."""
    n, d, inter, e, k, r = 13, 16, 8, 5, 2, 4
    x = torch.randn(n, d)
    weights = torch.rand(n, k)
    experts = torch.stack([torch.randperm(e - 1)[:k] for _ in range(n)])  # the last expert gets no token
    experts[0] = experts[1]
    stacks = [0.3 * torch.randn(e, 2 * inter, d), 0.3 * torch.randn(e, d, inter)]
    factors = [0.3 * torch.randn(e, r, d), 0.3 * torch.randn(e, 2 * inter, r), 0.3 * torch.randn(e, r, inter),
               0.3 * torch.randn(e, d, r)]
    # PEFT's layout, as LoraExperts holds them: A (E·r, in), B (out, r·E) with expert e's columns e, e + E, …
    peft_layout = [factors[0].reshape(e * r, d), factors[1].permute(1, 2, 0).reshape(2 * inter, r * e),
                   factors[2].reshape(e * r, inter), factors[3].permute(1, 2, 0).reshape(d, r * e)]
    leaves = [t.requires_grad_() for t in (x, weights, *stacks, *peft_layout)]
    out = experts_forward(x, weights, experts, *stacks, "silu", path,
                          ExpertsLora(peft_layout[0], peft_layout[1], 0.7, peft_layout[2], peft_layout[3], 1.3))
    exact = [t.detach().double().requires_grad_() for t in (x, weights, *stacks, *factors)]
    x64, w64, gate_up, down, a1, b1, a2, b2 = exact
    ref = torch.zeros(n, d, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            i = int(experts[t, j])
            g, u = ((gate_up[i] + 0.7 * b1[i] @ a1[i]) @ x64[t]).chunk(2)
            ref[t] = ref[t] + w64[t, j] * ((down[i] + 1.3 * b2[i] @ a2[i]) @ (torch.nn.functional.silu(g) * u))
    assert (out.double() - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    grad = torch.randn_like(ref)
    mine = list(torch.autograd.grad(out, leaves, grad.float()))
    for i in (4, 6):  # back to the per-expert stacks the loop differentiates
        mine[i] = mine[i].reshape(e, r, -1)
        mine[i + 1] = mine[i + 1].reshape(-1, r, e).permute(2, 0, 1)
    truth = torch.autograd.grad(ref, exact, grad)
    names = ("x", "weights", "gate_up", "down", "a1", "b1", "a2", "b2")
    for name, m, t in zip(names, mine, truth):
        assert (m.double() - t).abs().max().item() <= 1e-5 * max(1.0, t.abs().max().item()), name
    for m in mine[4:]:
        assert torch.all(m[e - 1] == 0) and m[0].abs().sum() > 0


FP32_MERGE = 3e-5  # merged or unmerged fp32 logits against the adapted ones (the spread: in the test)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_merge_unmerge_and_merged_export(family, tmp_path):
    """merge gives the adapted logits with the adapters folded in; unmerge restores the base; the merged export
    (per-expert names on disk, Mixtral's block_sparse_moe router included) loads in transformers with the same
    logits."""
    _, ours, _ = _pair(family, tmp_path)
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False))
    ours.eval()
    ids, _ = batch()
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    with torch.no_grad():
        adapted = ours(ids).logits
        merge_lora(ours)
        merged = ours(ids).logits
        unmerge_lora(ours)
        again = ours(ids).logits
    # fp32 roundings of W + s·B·A (init=False: B ~ N(0, 1/√r), an adapter as large as the base) through the tiny
    # model's MoE layers; 17 CPU draws (2026-12-07) gave 4e-7 to 4.9e-6 for the three comparisons, a CI draw 1.01e-5
    assert max_rel(merged, adapted) < FP32_MERGE and max_rel(again, adapted) < FP32_MERGE
    for n, p in ours.named_parameters():
        assert (p - before[n]).abs().max() <= 1e-6 * max(1.0, before[n].abs().max().item()), n
    kept = {n: p.detach().clone() for n, p in ours.named_parameters()}
    save_merged(ours, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    assert max_rel(theirs, adapted) < FP32_MERGE
    for n, p in ours.named_parameters():  # the export left the model as it was
        assert torch.equal(p, kept[n]), n


def test_parameter_targets_refuse_dropout_dora_and_unknown_names(tmp_path):
    _, ours, _ = _pair("mixtral", tmp_path)
    with pytest.raises(ValueError, match="neither dropout nor DoRA"):
        add_lora(ours, LoraSettings(r=4, dropout=0.1))
    with pytest.raises(ValueError, match="neither dropout nor DoRA"):
        add_lora(ours, LoraSettings(r=4, targets=["q_proj"], target_parameters=["down_proj"], use_dora=True))
    with pytest.raises(ValueError, match="not supported"):
        LoraSettings(target_parameters=["o_proj.weight"])
    _, dense, _ = (None, *_dense(tmp_path))
    with pytest.raises(ValueError, match="no mixture-of-experts blocks"):
        add_lora(dense, LoraSettings(targets=["q_proj"], target_parameters=["down_proj"]))


def _dense(tmp_path):
    hf = build_hf(transformers.LlamaConfig)
    return AutoLigerForCausalLM.from_pretrained(save_hf(hf, tmp_path / "llama"), dtype=torch.float32), None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compiled_training_step_matches_eager(family):
    """torch.compile(fullgraph=True) over a MoE model with all-linear adapters: the experts' adapters go through
    the routed-experts custom op (one graph, no break); loss, logits and every adapter gradient equal eager's
    within fp32 rounding (compiled LoRA linears take their composed path, eager ones the fused one)."""
    import liger_models
    from liger_models.auto import model_class

    torch._dynamo.reset()
    config = {"qwen3_moe": liger_models.Qwen3MoeConfig, "mixtral": liger_models.MixtralConfig}[family].tiny(
        output_router_logits=True)
    model = model_class(config.model_type).from_config(config).train()
    add_lora(model, LoraSettings(r=4, alpha=8, init=False))
    ids = torch.randint(3, 128, (2, 12))
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        loss = run(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            logits = run(ids).logits
        results.append((loss.detach(), logits, grads))
    (loss, logits, grads), (c_loss, c_logits, c_grads) = results
    assert any("experts.lora" in n for n in grads)
    assert max_rel(c_loss, loss) < 1e-6 and max_rel(c_logits, logits) < 1e-5
    for name, grad in grads.items():
        assert max_rel(c_grads[name], grad) < 1e-4, name


def _per_expert_adapter(hf, directory, family: str, r: int = 4, alpha: float = 8.0):
    """A transformers-v4-era PEFT adapter (per-expert linears, Mixtral's router too) with random A and B, and the
    HF model with those deltas merged into its stacked weights by hand (s·B·A per expert linear)."""
    from safetensors.torch import save_file

    config = hf.config
    experts, hidden = FAMILIES[family][1].get("num_local_experts") or config.num_experts, config.hidden_size
    inter = config.intermediate_size if family == "mixtral" else config.moe_intermediate_size
    names = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"), "qwen3_moe": ("mlp", "gate_proj", "up_proj",
                                                                           "down_proj")}[family]
    merged, tensors, s = copy.deepcopy(hf), {}, alpha / r
    for i, layer in enumerate(merged.model.layers):
        prefix = f"base_model.model.model.layers.{i}.{names[0]}"
        with torch.no_grad():
            for e in range(experts):
                for name, (fan_in, fan_out), rows in ((names[1], (hidden, inter), slice(0, inter)),
                                                      (names[2], (hidden, inter), slice(inter, 2 * inter)),
                                                      (names[3], (inter, hidden), None)):
                    a, b = 0.3 * torch.randn(r, fan_in), 0.3 * torch.randn(fan_out, r)
                    tensors[f"{prefix}.experts.{e}.{name}.lora_A.weight"] = a
                    tensors[f"{prefix}.experts.{e}.{name}.lora_B.weight"] = b
                    target = layer.mlp.experts.down_proj[e] if rows is None else layer.mlp.experts.gate_up_proj[e, rows]
                    target += s * b @ a
            if family == "mixtral":
                a, b = 0.3 * torch.randn(r, hidden), 0.3 * torch.randn(experts, r)
                tensors[f"{prefix}.gate.lora_A.weight"], tensors[f"{prefix}.gate.lora_B.weight"] = a, b
                layer.mlp.gate.weight += s * b @ a
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    targets = list(names[1:]) + (["gate"] if family == "mixtral" else [])
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "target_modules": targets}))
    return merged


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_v4_per_expert_adapter_loads_stacked(family, tmp_path):
    """An adapter saved against transformers v4's per-expert linears loads into the stacked experts: the logits of
    HF with the deltas merged by hand, and of HF + PEFT's own conversion of the same files."""
    hf, ours, _ = _pair(family, tmp_path)
    merged = _per_expert_adapter(hf, tmp_path / "v4", family)
    names = load_adapter(ours, tmp_path / "v4")
    assert sum(n.endswith("mlp.experts") for n in names) == hf.config.num_hidden_layers
    assert ours.model.layers[0].mlp.experts.lora["gate_up_proj"].r == 8
    ids, _ = batch()
    with torch.no_grad():
        got = ours.eval()(ids).logits
        expected = merged(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "v4").eval()(input_ids=ids).logits
    assert max_rel(got, expected) < 1e-5 and max_rel(theirs, expected) < 1e-5


def test_per_expert_adapter_missing_up_or_an_expert_is_refused(tmp_path):
    hf, ours, _ = _pair("mixtral", tmp_path)
    _per_expert_adapter(hf, tmp_path / "v4", "mixtral")
    path = tmp_path / "v4" / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items() if ".experts.2.w2." not in k}, str(path))
    with pytest.raises(ValueError, match=r"down adapters for experts \[0, 1, 3\]"):
        load_adapter(ours, tmp_path / "v4")
    save_file({k: v for k, v in tensors.items() if ".w3." not in k}, str(path))
    _, fresh, _ = _pair("mixtral", tmp_path / "again")
    with pytest.raises(ValueError, match="without the other"):
        load_adapter(fresh, tmp_path / "v4")


@pytest.mark.parametrize("r", [1, 4, 8, 12])
def test_stacks_pad_the_rank_to_grouped_mm_strides_without_changing_the_product(r):
    """bf16 stacks carry r rounded up to 8 (16 bytes, torch's grouped GEMM stride rule) with zero rows / columns:
    B_e·A_e is each expert's own, and the padding passes no gradient back to the adapter."""
    from liger_models.modules.lora_experts import ExpertsAdapter
    from liger_models.modules.moe import stack_factors, _unstacked

    adapter = ExpertsAdapter(3, 24, 40, r, 8.0, False, "cpu", torch.float32)
    adapter.reset(False)
    a, b = stack_factors(adapter.lora_A, adapter.lora_B, 3, torch.bfloat16)
    padded = -(-r // 8) * 8
    assert a.shape == (3, padded, 24) and b.shape == (3, 40, padded)
    for e in range(3):
        a_e = adapter.lora_A[e * r:(e + 1) * r].to(torch.bfloat16).float()
        b_e = adapter.lora_B[:, e::3].to(torch.bfloat16).float()
        assert torch.equal(b[e].float() @ a[e].float(), b_e @ a_e)
    grad_a, grad_b = _unstacked(torch.ones_like(a), torch.ones_like(b), adapter.lora_A, adapter.lora_B, 3)
    assert grad_a.shape == adapter.lora_A.shape and grad_b.shape == adapter.lora_B.shape
    assert grad_a.dtype == grad_b.dtype == torch.float32


def test_save_pretrained_refuses_expert_adapters(tmp_path):
    """Adapters on the experts alone (no LoRA linear anywhere) are still refused by save_pretrained: a dense HF
    checkpoint would hold them under names transformers ignores."""
    _, ours, _ = _pair("qwen3_moe", tmp_path)
    add_lora(ours, LoraSettings(r=4, targets=[], target_parameters=["down_proj"]))
    with pytest.raises(ValueError, match="carries LoRA adapters"):
        ours.save_pretrained(tmp_path / "out")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qlora_with_nf4_experts_matches_float64_peft_on_the_dequantised_base(family, tmp_path):
    """QLoRA on a MoE model: quantize_base_ puts the attention linears and both expert stacks in NF4 (the routers
    stay dense); all-linear adapters train against float64 HF + PEFT whose base holds the dequantised weights; no
    dequantised expert stack is saved for backward."""
    from liger_models.lora import quantize_base_
    from liger_models.modules.lora_linear import LoraLinear

    hf, ours, _ = _pair(family, tmp_path)
    quantized = quantize_base_(ours)
    assert {n.rsplit(".", 1)[1] for n in quantized} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                         "down_proj"}
    base = copy.deepcopy(hf)
    with torch.no_grad():
        for name, m in ours.named_modules():
            if isinstance(m, LoraLinear) and m.quant is not None:
                base.get_submodule(name).weight.copy_(m.base_weight(torch.float32))
            if name.endswith("mlp.experts"):
                for stack in ("gate_up_proj", "down_proj"):
                    getattr(base.get_submodule(name), stack).copy_(m.dense_stack(stack, torch.float32))
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False))
    save_adapter(ours, tmp_path / "adapter")
    truth = peft.PeftModel.from_pretrained(float64_reference(base), tmp_path / "adapter", is_trainable=True).double()
    _assert_step_matches(ours, truth)

    stacks = {tuple(ours.model.layers[0].mlp.experts.nf4[s].shape) for s in ("gate_up_proj", "down_proj")}
    saved = []
    ids, labels = batch()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = ours(ids, labels=labels).loss
    loss.backward()
    assert not [s for s in saved if s in stacks]


@pytest.mark.parametrize("targets", ["all-linear", "attention"])
def test_merged_export_of_a_qlora_moe_model(targets, tmp_path):
    """save_merged on a MoE model with NF4 experts: the stacks are written dequantised (merged where adapted) under
    the per-expert names; transformers loads the file with ours' logits. With adapters on the attention only the
    NF4 experts must still be written (they are not in the state dict)."""
    from liger_models.lora import quantize_base_

    _, ours, _ = _pair("mixtral", tmp_path)
    quantize_base_(ours)
    add_lora(ours, LoraSettings(r=4, alpha=8, init=False,
                                targets="all-linear" if targets == "all-linear" else ["q_proj", "v_proj"]))
    save_merged(ours, tmp_path / "merged", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids, _ = batch()
    # Judged by transformers in float64 on the merged file (per-expert loop: float64 has no grouped_mm CPU kernel):
    # ours and transformers in fp32 are two roundings of the same sums, 1.6e-5 of the largest logit apart on one
    # seed in 60 (27), each within fp32's reach of the float64 logits.
    exact_model = copy.deepcopy(hf).double()
    exact_model.set_experts_implementation("eager")
    with torch.no_grad():
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, hf(ids).logits, exact_model(ids).logits,
                                       redraw=ulp_moved_logits(ours, ids))
    assert ours.model.layers[0].mlp.experts.gate_up_proj is None  # the export left the NF4 stacks as they were
