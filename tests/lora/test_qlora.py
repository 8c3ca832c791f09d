"""QLoRA: NF4 bases (quantised on load, or read from a bitsandbytes 4-bit checkpoint) under the fused LoRA paths."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.lora import load_bnb_4bit, lora_modules, lora_state_dict, quantize_base_, save_bnb_4bit, save_merged
from liger_models.modules.lora_linear import LoraLinear
from liger_models.train.optim import decay_param_groups

from ..models.parity import float64_reference, max_rel
from .bnb import import_bnb
from .common import assert_matches_float64_peft, batch, pair, peft_float64, with_adapters

pytest.importorskip("peft")


def _dequantised_hf(hf, ours):
    """HF with every quantised linear's weight replaced by ours' dequantised NF4 weight."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for name, m in ours.named_modules():
            if isinstance(m, LoraLinear) and m.quant is not None:
                hf.get_submodule(name).weight.copy_(m.base_weight(torch.float32))
    return hf


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma"])
def test_qlora_matches_float64_reference_on_the_dequantised_base(family, tmp_path):
    hf, ours, _ = pair(family, tmp_path)
    quantized = quantize_base_(ours)
    assert quantized and all(ours.get_submodule(n).weight is None for n in quantized)
    with_adapters(ours, family, "all-linear")
    truth = peft_float64(_dequantised_hf(hf, ours), ours, tmp_path)
    grads = assert_matches_float64_peft(ours, truth)
    assert len(grads) == 2 * len(lora_modules(ours))


def test_nf4_weights_are_never_saved_for_backward(tmp_path):
    """The dequantised weight is a per-call temporary: nothing of a weight's shape is kept for backward."""
    _, ours, _ = pair("llama", tmp_path)
    quantize_base_(ours)
    with_adapters(ours, "llama", "all-linear")
    shapes = {(m.out_features, m.in_features) for m in lora_modules(ours).values()}
    shapes |= {(s[1], s[0]) for s in shapes}
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    ids, labels = batch()
    ours.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = ours(ids, labels=labels).loss
    loss.backward()
    weight_like = [s for s in saved if s in shapes]
    assert not weight_like, weight_like[:3]


def test_nf4_tensors_are_frozen_uint8_parameters_outside_the_state_dict(tmp_path):
    """Codes and scales are Parameters (what fully_shard shards: tests/train/test_distributed.py), uint8 so that
    ``.to(dtype)`` leaves them as they are (scales held as fp32 would be rounded by ``.to(torch.bfloat16)``), and
    frozen: no trainable count, optimizer group, state dict or adapter file holds them."""
    _, ours, _ = pair("llama", tmp_path)
    quantized = quantize_base_(ours)
    with_adapters(ours, "llama", "all-linear")
    nf4 = {n: p for n, p in ours.named_parameters() if ".quant." in n}
    assert len(nf4) == 2 * len(quantized)
    assert all(p.dtype == torch.uint8 and not p.requires_grad for p in nf4.values())
    saved = {n: p.detach().clone() for n, p in nf4.items()}
    weights = {n: ours.get_submodule(n).base_weight(torch.float32) for n in quantized}
    ours.to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    assert all(p.dtype == torch.uint8 and torch.equal(p, saved[n]) for n, p in ours.named_parameters() if n in saved)
    for name, weight in weights.items():  # dequantised from the same fp32 scales, to fp32
        assert torch.equal(ours.get_submodule(name).base_weight(torch.float32), weight), name

    adapters = lora_state_dict(ours)
    state = ours.state_dict()
    assert not [k for k in [*state, *adapters] if ".quant." in k]
    ours.load_state_dict(state)  # strict: nothing missing
    with pytest.raises(RuntimeError, match=r"Unexpected key.*quant\.codes"):
        ours.load_state_dict({**state, f"{quantized[0]}.quant.codes": saved[f"{quantized[0]}.quant.codes"]})
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == set(adapters)
    assert ours.num_parameters(only_trainable=True) == sum(p.numel() for p in adapters.values())
    optimized = [p for group in decay_param_groups(ours, 1e-3, 0.0) for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in adapters.values()}
    with pytest.raises(RuntimeError, match="floating point"):
        nf4[f"{quantized[0]}.quant.codes"].requires_grad_(True)


def test_bnb_checkpoint_loads_as_it_is_and_matches_quantise_on_load(tmp_path):
    _, ours, directory = pair("qwen2", tmp_path)
    save_bnb_4bit(ours, tmp_path / "bnb")
    loaded = load_bnb_4bit(tmp_path / "bnb", dtype=torch.float32)
    reference = copy.deepcopy(ours)
    quantize_base_(reference)
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference.eval()(ids).logits)
    bnb = import_bnb()
    if bnb is not None:  # bitsandbytes reads the file's quant states and dequantises what we do
        from safetensors.torch import load_file

        tensors = load_file(str(tmp_path / "bnb" / "model.safetensors"))
        # A row length that is a multiple of 64: bitsandbytes 0.50.2's CPU dequantize_4bit disagrees with its own
        # quantiser (and with its CUDA layout) when blocks straddle rows of an even length, e.g. [64, 96].
        name = "model.layers.1.self_attn.q_proj"
        state = bnb.functional.QuantState.from_dict(
            {k[len(name) + 8:]: v for k, v in tensors.items() if k.startswith(name + ".weight.")}, device="cpu")
        theirs = bnb.functional.dequantize_4bit(tensors[name + ".weight"], state)
        assert torch.equal(theirs, loaded.get_submodule(name).base_weight(torch.float32))


def test_bnb_loader_refuses_what_it_cannot_read(tmp_path):
    import json

    _, ours, directory = pair("llama", tmp_path)
    with pytest.raises(ValueError, match="no bitsandbytes 4-bit quantization_config"):
        load_bnb_4bit(directory)
    save_bnb_4bit(ours, tmp_path / "bnb")
    cfg = json.loads((tmp_path / "bnb" / "config.json").read_text())
    cfg["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
    (tmp_path / "bnb" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="fp4"):
        load_bnb_4bit(tmp_path / "bnb")


def test_qlora_merged_export_is_the_dequantised_base_plus_delta(tmp_path):
    """What transformers loads from the merged checkpoint is, for every adapted linear, dequant(NF4) + s·B·A rounded
    once to fp32 (the delta formed in fp32 first: within 2 fp32 ulps of the float64 sum's largest element), and every
    other tensor as ours holds it; its float64 logits are within 1e-5 of those of the unrounded sums. Not compared:
    ours' fp32 logits with HF's fp32 on the merged file, two computations of different conditioning (ours adds
    x·Wᵀ and s·(x·Aᵀ)·Bᵀ, which random tiny adapters make large and cancelling: one seed gave 1.0e-5 against
    0.07e-5 from the same float64 truth). Ours' own fp32 accuracy against HF + PEFT in float64, with an fp32 peer
    of the same computation, is the first test of this file."""
    _, ours, _ = pair("llama", tmp_path)
    quantize_base_(ours)
    with_adapters(ours, "llama", "all-linear")
    save_merged(ours, tmp_path / "merged", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    loaded = {name: p.detach() for name, p in hf.named_parameters()}
    unrounded = {}
    eps = torch.finfo(torch.float32).eps
    for name, m in lora_modules(ours).items():
        delta = m.scaling * (m.lora_B.weight.double() @ m.lora_A.weight.double())
        exact = m.base_weight(torch.float32).double() + delta
        err = (loaded[f"{name}.weight"].double() - exact).abs().max().item()
        assert err <= 2 * eps * exact.abs().max().item(), (name, err)
        unrounded[f"{name}.weight"] = exact
    assert len(unrounded) == 7 * ours.config.num_hidden_layers
    own = ours.state_dict()
    others = [key for key in loaded if key not in unrounded]
    assert others and all(torch.equal(loaded[key], own[key]) for key in others)
    ids, _ = batch()
    with torch.no_grad():
        reference = float64_reference(hf)
        from_file = reference(input_ids=ids).logits
        reference.load_state_dict(unrounded, strict=False)
        assert max_rel(from_file, reference(input_ids=ids).logits) <= 1e-5


def test_parameter_counts_of_an_nf4_base_are_its_weights(tmp_path):
    # HF counts a bitsandbytes 4-bit weight as its number of weights (two per stored byte); the block scales are
    # not parameters there.
    _, dense, _ = pair("llama", tmp_path)
    before = (dense.num_parameters(), dense.num_parameters(exclude_embeddings=True))
    quantize_base_(dense)
    assert (dense.num_parameters(), dense.num_parameters(exclude_embeddings=True)) == before


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "mixtral"])
def test_a_model_already_in_nf4_saves_as_a_bnb_checkpoint_as_it_is(family, tmp_path):
    """save_bnb_4bit of a model after quantize_base_ (what save_pretrained's refusal points to): the linears'
    own codes and scales, mixture-of-experts stacks dequantised under the family's per-expert names (transformers'
    bitsandbytes path keeps experts dense); it loads back with the same logits. Adapters are refused by name."""
    from liger_models import AutoLigerForCausalLM
    from liger_models.auto import model_class
    import liger_models

    if family == "qwen2":
        _, ours, _ = pair(family, tmp_path)
    else:
        config = {"qwen3_moe": liger_models.Qwen3MoeConfig, "mixtral": liger_models.MixtralConfig}[family].tiny()
        ours = model_class(config.model_type).from_config(config)
    quantized = quantize_base_(ours)
    assert any("experts" in n for n in quantized) == (family != "qwen2")
    save_bnb_4bit(ours, tmp_path / "bnb")
    loaded = load_bnb_4bit(tmp_path / "bnb", dtype=torch.float32)
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, ours.eval()(ids).logits)
    if family != "qwen2":  # the experts were written dense, under the checkpoints' per-expert names
        from safetensors.torch import load_file

        expert = {"qwen3_moe": "mlp.experts.1.down_proj", "mixtral": "block_sparse_moe.experts.1.w2"}[family]
        stored = load_file(str(tmp_path / "bnb" / "model.safetensors"))[f"model.layers.0.{expert}.weight"]
        assert torch.equal(stored, ours.model.layers[0].mlp.experts.dense_stack("down_proj", stored.dtype)[1])
    with pytest.raises(ValueError, match="quantized checkpoint .*bitsandbytes 4-bit.*load_bnb_4bit"):
        AutoLigerForCausalLM.from_pretrained(tmp_path / "bnb")
    with_adapters(ours, "llama", "attention")
    with pytest.raises(ValueError, match="carries LoRA adapters"):
        save_bnb_4bit(ours, tmp_path / "again")


# The peak resident memory of one load in a fresh process: /proc's VmHWM (the high-water mark of this address space;
# getrusage's ru_maxrss would carry the parent's across exec) against the resident size before it.
_PEAK_OF_A_LOAD = """
import sys, torch
from liger_models.lora import load_bnb_4bit
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
before = kib("VmRSS")
model = load_bnb_4bit(sys.argv[1], dtype=torch.float32)
print((kib("VmHWM") - before) * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_bnb_checkpoint_loads_without_the_dense_model_in_memory(tmp_path):
    """The loader never allocates the dense weights of the linears it fills with NF4 codes: the peak memory of a
    load (a fresh process, host memory) stays well under the dense fp32 weights of those linears (300 MB here),
    where building the dense model first took them all, as it would take a GPU's memory."""
    from liger_models import LlamaConfig, LigerLlamaForCausalLM

    config = LlamaConfig.tiny(vocab_size=256, hidden_size=768, intermediate_size=3072, num_hidden_layers=8,
                              num_attention_heads=12, num_key_value_heads=12, head_dim=64)
    model = LigerLlamaForCausalLM.from_config(config)
    dense = sum(m.weight.numel() * 4 for n, m in model.named_modules() if n.endswith(("proj",)) and
                hasattr(m, "weight") and m.weight is not None and "layers" in n)
    save_bnb_4bit(model, tmp_path / "bnb")
    del model
    peak = subprocess.run([sys.executable, "-c", _PEAK_OF_A_LOAD, str(tmp_path / "bnb")], capture_output=True,
                          text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    assert int(peak.stdout.split()[-1]) < 0.5 * dense, (peak.stdout, dense)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_quantised_as_it_loads_is_the_base_quantised_after(family, tmp_path):
    """load_causal_lm(quantise=True), the dense weights sent one at a time to be quantised: the same NF4 codes and
    scales (experts' stacks too), biases and logits as quantize_base_ on the model loaded whole."""
    from liger_models.lora import load_causal_lm

    if family == "qwen3_moe":
        import liger_models
        from liger_models.auto import model_class

        directory = tmp_path / family
        model_class(family).from_config(liger_models.Qwen3MoeConfig.tiny()).save_pretrained(directory)
        ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    else:
        _, ours, directory = pair(family, tmp_path)
    loaded = load_causal_lm(directory, dtype=torch.float32, device="cpu", quantise=True)
    quantize_base_(ours)
    mine, theirs = dict(loaded.named_parameters()), dict(ours.named_parameters())
    assert mine.keys() == theirs.keys() and any(".codes" in k for k in mine)
    assert any("experts.nf4" in k for k in mine) == (family == "qwen3_moe")
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ours.eval()(ids).logits)
