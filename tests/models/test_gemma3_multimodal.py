"""Gemma 3's multimodal checkpoints (model_type gemma3, Gemma3ForConditionalGeneration: the 4B-27B repos) load as
their text decoder, train, and save back whole: against transformers' own multimodal model on tiny local checkpoints
in both layouts of the decoder's names, with adapters through PEFT both ways and a merged export."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from liger_models import AutoLigerForCausalLM, LigerGemma3ForCausalLM
from liger_models.auto import model_class
from liger_models.kernels.ops.nf4 import bnb_tensors, dequantize_nf4_reference, from_bnb_tensors
from liger_models.lora import (LoraSettings, add_lora, load_adapter, load_bnb_4bit, quantize_base_, save_adapter,
                               save_bnb_4bit, save_merged)

from ..lora.common import assert_as_close_as_fp32_allows, ulp_moved_logits
from .parity import build_gemma3_multimodal as build_multimodal
from .parity import float64_reference, max_rel, perturb_norms

peft = pytest.importorskip("peft")
VOCAB = 300  # parity.build_gemma3_multimodal's; 297-299 are image tokens, never in the text batches below
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def text_batch(rows: int = 2, length: int = 13) -> torch.Tensor:
    return torch.randint(3, 297, (rows, length))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def saved_and_loaded(hf, source, layout: str):
    """``hf`` saved into ``source`` in ``layout`` ("saved": as transformers writes it; "modules": v5's module names),
    and this project's model of that checkpoint, in fp32."""
    hf.save_pretrained(source)
    if layout == "modules":
        to_module_layout(source)
    return AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)


def to_module_layout(directory) -> None:
    """Rewrite a saved checkpoint under transformers v5's module names (model.language_model.*, model.vision_tower.*,
    lm_head.weight), the other layout transformers reads."""
    path = directory / "model.safetensors"
    renamed = {}
    for name, t in load_file(str(path)).items():
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = t
    save_file(renamed, str(path), metadata={"format": "pt"})


@pytest.fixture
def checkpoint(tmp_path):
    hf = build_multimodal()
    hf.save_pretrained(tmp_path / "mm")
    return hf, tmp_path / "mm"


def test_model_class_of_the_multimodal_type_is_the_text_family():
    assert model_class("gemma3") is LigerGemma3ForCausalLM


@pytest.mark.parametrize("layout", ["saved", "modules"])
@pytest.mark.parametrize("tied", [True, False])
def test_loads_as_its_decoder_with_transformers_logits_and_saves_back_whole(tmp_path, layout, tied):
    hf = build_multimodal(tied)
    source = tmp_path / "mm"
    ours = saved_and_loaded(hf, source, layout)
    assert type(ours) is LigerGemma3ForCausalLM and ours.checkpoint_wrapper.layout == layout
    assert ours.config.tie_word_embeddings is tied and ours.config.vocab_size == VOCAB
    ids = text_batch()
    with torch.no_grad():
        logits = ours(ids).logits
    assert max_rel(logits, hf_logits(hf, ids)) < 1e-5

    with torch.no_grad():  # a trained decoder: one weight moved
        ours.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    ours.save_pretrained(tmp_path / "out")
    before, after = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "out/model.safetensors"))
    assert set(after) == set(before)  # the same names, the vision tower's and projector's included
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved == [("model.language_model." if layout == "modules" else "language_model.model.")
                     + "layers.1.mlp.down_proj.weight"]
    config_in, config_out = (json.loads((d / "config.json").read_text()) for d in (source, tmp_path / "out"))
    assert config_out["model_type"] == "gemma3" and config_out["vision_config"] == config_in["vision_config"]
    assert {k: config_out["text_config"][k] for k in config_in["text_config"]
            if not k.startswith("_")} == {k: v for k, v in config_in["text_config"].items() if not k.startswith("_")}
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        assert max_rel(ours(ids).logits, hf_logits(reloaded.eval(), ids)) < 1e-5
    again = AutoLigerForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def test_training_loss_and_gradients_match_transformers(checkpoint):
    hf, source = checkpoint
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32).train()
    hf.train()
    ids = text_batch()
    labels = ids.clone()
    labels[0, :4] = -100
    loss = ours(ids, labels=labels).loss
    hf_loss = hf(input_ids=ids, labels=labels).loss
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())
    loss.backward()
    hf_loss.backward()
    ours_grad = ours.model.layers[0].self_attn.q_proj.weight.grad
    hf_grad = hf.model.language_model.layers[0].self_attn.q_proj.weight.grad
    assert max_rel(ours_grad, hf_grad) < 1e-4


def test_refused_clearly(tmp_path, checkpoint):
    _, source = checkpoint
    config = json.loads((source / "config.json").read_text())
    broken = tmp_path / "no_text_config"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "text_config"}))
    save_file({"x": torch.zeros(1)}, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="has no text_config"):
        AutoLigerForCausalLM.from_pretrained(broken)
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot tell where the text decoder"):
        AutoLigerForCausalLM.from_pretrained(broken)


def test_our_adapter_loads_in_hf_peft_on_the_multimodal_model(checkpoint, tmp_path):
    hf, source = checkpoint
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets="all-linear", init=False))
    save_adapter(ours, tmp_path / "adapter")
    saved = load_file(str(tmp_path / "adapter/adapter_model.safetensors"))
    assert saved and all(k.startswith("base_model.model.model.language_model.layers.") for k in saved)
    clean = copy.deepcopy(hf)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    adapted = [n for n, m in loaded.named_modules() if hasattr(m, "lora_A")]
    assert adapted and not [n for n in adapted if "vision_tower" in n or "multi_modal_projector" in n]
    ids = text_batch()
    exact = peft.PeftModel.from_pretrained(float64_reference(clean), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, hf_logits(loaded, ids), hf_logits(exact, ids),
                                       redraw=ulp_moved_logits(ours, ids))


def test_hf_peft_adapter_on_the_multimodal_model_loads_here(checkpoint, tmp_path):
    hf, source = checkpoint
    clean = copy.deepcopy(hf)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=LINEARS, exclude_modules=r".*vision_tower.*",
                             init_lora_weights=False)
    trained = peft.get_peft_model(hf, config)
    trained.save_pretrained(tmp_path / "hf_adapter")
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    names = load_adapter(ours, tmp_path / "hf_adapter")
    assert len(names) == 3 * len(LINEARS)
    ids = text_batch()
    exact = peft.PeftModel.from_pretrained(float64_reference(clean), tmp_path / "hf_adapter").eval()
    with torch.no_grad():
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, hf_logits(trained.eval(), ids),
                                       hf_logits(exact, ids), redraw=ulp_moved_logits(ours, ids))


def test_adapters_on_the_vision_tower_or_excluding_decoder_modules_are_refused(checkpoint, tmp_path):
    hf, source = checkpoint
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    trained.save_pretrained(tmp_path / "with_vision")  # q_proj is also the SigLIP attention's
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    with pytest.raises(ValueError, match="vision tower or projector"):
        load_adapter(ours, tmp_path / "with_vision")
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj"]))
    save_adapter(ours, tmp_path / "ours")
    cfg_path = tmp_path / "ours/adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["exclude_modules"] = ["layers.0.self_attn.v_proj"]
    cfg_path.write_text(json.dumps(cfg))
    fresh = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    with pytest.raises(ValueError, match="excludes 'model.layers.0.self_attn.v_proj'"):
        load_adapter(fresh, tmp_path / "ours")


def test_merged_export_is_the_whole_multimodal_checkpoint(checkpoint, tmp_path):
    """The merged checkpoint, as transformers loads it, computing in float64: its logits as close to float64 HF +
    PEFT as the adapted model's own fp32 logits are (twice that, or 1e-5), W + s·B·A rounded once to fp32 being all
    that may differ (parity.float64_reference)."""
    hf, source = checkpoint
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets="all-linear", init=False))
    save_adapter(ours, tmp_path / "adapter")
    exact = peft.PeftModel.from_pretrained(float64_reference(hf), tmp_path / "adapter").eval()
    save_merged(ours, tmp_path / "merged")
    before, after = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "merged/model.safetensors"))
    assert set(after) == set(before)
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("language_model."))
    merged = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = text_batch()
    with torch.no_grad():
        truth = hf_logits(exact, ids)
        bound = max(2 * max_rel(ours.eval()(ids).logits.double(), truth), 1e-5)
        assert max_rel(hf_logits(float64_reference(merged), ids), truth) <= bound


# The config.json files of google/gemma-3-4b-it and google/gemma-3-27b-it: text_config names few keys, transformers'
# Gemma3TextConfig defaults fill the rest, and the top level carries eos_token_id and the dtype.
REAL = {
    "gemma-3-4b-it": {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                      "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
                      "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
                      "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                      "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                      "sliding_window": 1024},
                      "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
                      "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                        "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                        "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
}
REAL["gemma-3-27b-it"] = {**REAL["gemma-3-4b-it"], "text_config": {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "sliding_window_pattern": 6}}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_multimodal_configs_load_with_transformers_logits(name, tmp_path):
    """Each file with the decoder shrunk (6 layers: five sliding, one full; hidden 64, a 512-token vocabulary, a
    4-token window) and a one-layer vision tower, the real head sizes, RoPE and scales kept."""
    raw = copy.deepcopy(REAL[name])
    raw["text_config"].update(num_hidden_layers=6, hidden_size=64, intermediate_size=96, vocab_size=512,
                              sliding_window=4)
    raw["vision_config"].update(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28)
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(directory)
    hf = transformers.Gemma3ForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    perturb_norms(hf)
    hf.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(raw))  # the file as the Hub serves it
    ours = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
    text = hf.config.text_config
    assert (ours.config.head_dim, ours.config.num_attention_heads, ours.config.query_pre_attn_scalar) == (
        text.head_dim, text.num_attention_heads, text.query_pre_attn_scalar)
    assert ours.config.layer_types == text.layer_types and ours.config.eos_token_id == [1, 106]
    ids = torch.randint(0, 512, (2, 13))
    with torch.no_grad():
        assert max_rel(ours(ids).logits, hf_logits(hf, ids)) < 1e-5


def test_bnb_4bit_multimodal_checkpoint_round_trips_as_quantise_on_load(checkpoint, tmp_path):
    """save_bnb_4bit writes the whole multimodal checkpoint (the decoder's linears in NF4, the vision tower and
    projector as they were, named in llm_int8_skip_modules); load_bnb_4bit reads it back as the NF4 decoder that
    quantising on load gives, bit for bit."""
    _, source = checkpoint
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    reference = copy.deepcopy(ours)
    quantize_base_(reference)
    save_bnb_4bit(ours, tmp_path / "bnb")
    config = json.loads((tmp_path / "bnb/config.json").read_text())
    assert config["model_type"] == "gemma3" and config["text_config"]["hidden_size"] == 64
    assert config["quantization_config"]["llm_int8_skip_modules"] == ["multi_modal_projector", "vision_tower",
                                                                      "lm_head"]
    before, saved = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "bnb/model.safetensors"))
    assert all(torch.equal(before[k], saved[k]) for k in before if not k.startswith("language_model."))
    assert "language_model.model.layers.0.self_attn.q_proj.weight.absmax" in saved  # the decoder in NF4
    loaded = load_bnb_4bit(tmp_path / "bnb", dtype=torch.float32)
    ids = text_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference.eval()(ids).logits)


def test_bnb_4bit_vision_tower_is_kept_dequantised_and_exported_dense(checkpoint, tmp_path):
    """A checkpoint whose vision tower is in 4-bit too (as some published ones are): its linears are kept
    dequantised beside the decoder, and the merged export is a dense multimodal checkpoint transformers loads."""
    _, source = checkpoint
    save_bnb_4bit(AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32), tmp_path / "bnb")
    path = tmp_path / "bnb/model.safetensors"
    tensors = load_file(str(path))
    vision = "vision_tower.encoder.layers.0.self_attn.q_proj"  # as transformers 5 saves SigLIP
    tensors.update({f"{vision}.{suffix}": t for suffix, t in bnb_tensors(tensors.pop(f"{vision}.weight")).items()})
    save_file(tensors, str(path), metadata={"format": "pt"})
    loaded = load_bnb_4bit(tmp_path / "bnb", dtype=torch.float32)
    carried = loaded.checkpoint_wrapper.carried
    codes, absmax, state = from_bnb_tensors(tensors, vision)
    assert torch.equal(carried[f"{vision}.weight"], dequantize_nf4_reference(codes, absmax, tuple(state["shape"]),
                                                                             torch.float32))
    assert not [k for k in carried if k.startswith(f"{vision}.weight.")]
    save_merged(loaded, tmp_path / "merged")
    assert "quantization_config" not in json.loads((tmp_path / "merged/config.json").read_text())
    merged = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    [exported] = [p for n, p in merged.named_parameters() if n.endswith(f"{vision}.weight")]
    assert torch.equal(exported, carried[f"{vision}.weight"])
    ids = text_batch()
    with torch.no_grad():
        assert max_rel(hf_logits(merged.eval(), ids), loaded(ids).logits) < 1e-5


def test_medusa_stage_2_directory_is_the_whole_multimodal_checkpoint_with_heads(checkpoint, tmp_path):
    """Medusa-2 on a multimodal base: the stage-2 directory is the multimodal checkpoint (vision tower unchanged,
    medusa_* keys beside text_config) plus the heads, which MedusaModel and transformers both load."""
    from liger_models.medusa import MedusaModel

    hf, source = checkpoint
    base = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32)
    medusa = MedusaModel.from_base(base, stage=2, num_heads=2)
    medusa.save_pretrained(str(tmp_path / "stage2"))
    config = json.loads((tmp_path / "stage2/config.json").read_text())
    assert config["model_type"] == "gemma3" and config["medusa_num_heads"] == 2 and "text_config" in config
    saved = load_file(str(tmp_path / "stage2/model.safetensors"))
    assert set(saved) == set(load_file(str(source / "model.safetensors")))
    again = MedusaModel.from_pretrained(str(tmp_path / "stage2"), dtype=torch.float32)
    assert again.base.checkpoint_wrapper is not None and again.stage == 2
    assert all(torch.equal(a, b) for a, b in zip(again.heads.state_dict().values(), medusa.heads.state_dict().values()))
    reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "stage2", dtype=torch.float32)
    ids = text_batch()
    with torch.no_grad():
        assert max_rel(hf_logits(reloaded.eval(), ids), hf_logits(hf, ids)) == 0


def test_a_mismatched_decoder_tensor_is_named_as_the_file_names_it(checkpoint, tmp_path):
    _, source = checkpoint
    config = json.loads((source / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 128  # the file's MLP weights are 96 wide
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"language_model\.model\.layers\.0\.mlp\.down_proj\.weight: checkpoint"):
        AutoLigerForCausalLM.from_pretrained(source)


@pytest.mark.gpu
def test_on_cuda_loads_trains_and_saves_back_whole(checkpoint, tmp_path):
    """On the GPU (the Triton kernels in fp32): logits and loss as transformers' multimodal model's on CUDA, one
    training step, and a save from the CUDA model that keeps the vision tower byte-equal."""
    hf, source = checkpoint
    hf = hf.cuda()
    ours = AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32, device="cuda")
    assert all(t.device.type == "cpu" for t in ours.checkpoint_wrapper.carried.values())  # host memory only
    ids = text_batch().cuda()
    with torch.no_grad():
        assert max_rel(ours(ids).logits, hf_logits(hf, ids)) < 1e-4
        loss, hf_loss = ours(ids, labels=ids).loss, hf(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - hf_loss.item()) <= 1e-4 * abs(hf_loss.item())
    ours.train()
    ours(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in ours.parameters():
            p.sub_(1e-2 * p.grad)
    ours.save_pretrained(tmp_path / "out")
    before, after = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "out/model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("language_model."))
    assert not torch.equal(before["language_model.model.layers.0.self_attn.q_proj.weight"],
                           after["language_model.model.layers.0.self_attn.q_proj.weight"])


def test_a_bnb_4bit_multimodal_checkpoint_given_to_from_pretrained_names_its_loader(checkpoint, tmp_path):
    # quantization_config sits at the top level, beside text_config: the error still finds it
    _, source = checkpoint
    save_bnb_4bit(AutoLigerForCausalLM.from_pretrained(source, dtype=torch.float32), tmp_path / "bnb")
    with pytest.raises(ValueError, match="bitsandbytes 4-bit.*load_bnb_4bit"):
        AutoLigerForCausalLM.from_pretrained(tmp_path / "bnb")
