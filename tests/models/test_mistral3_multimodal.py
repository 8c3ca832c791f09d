"""Mistral Small 3.1 / 3.2's multimodal checkpoints (model_type mistral3, Mistral3ForConditionalGeneration) load as
their Mistral text decoder and save back whole, as Gemma 3's do (test_gemma3_multimodal.py has the full set): against
transformers' own multimodal model on tiny local checkpoints, and adapters through PEFT on it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from liger_models import AutoLigerForCausalLM, LigerMistralForCausalLM
from liger_models.lora import LoraSettings, add_lora, save_adapter

from ..lora.common import assert_as_close_as_fp32_allows, ulp_moved_logits
from .parity import build_mistral3_multimodal, float64_reference, max_rel, perturb_norms
from .test_gemma3_multimodal import saved_and_loaded

peft = pytest.importorskip("peft")


def text_batch() -> torch.Tensor:
    return torch.randint(3, 299, (2, 13))


@pytest.mark.parametrize("layout", ["saved", "modules"])
@pytest.mark.parametrize("tied", [False, True])
def test_loads_as_its_decoder_with_transformers_logits_and_saves_back_whole(tmp_path, layout, tied):
    hf = build_mistral3_multimodal(tied)
    source = tmp_path / "mm"
    ours = saved_and_loaded(hf, source, layout)
    assert type(ours) is LigerMistralForCausalLM and ours.checkpoint_wrapper.layout == layout
    assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) is tied  # the top level decides
    assert ours.config.tie_word_embeddings is tied and ours.config.sliding_window is None
    ids = text_batch()
    with torch.no_grad():
        assert max_rel(ours(ids).logits, hf(input_ids=ids).logits) < 1e-5
    ours.save_pretrained(tmp_path / "out")
    before, after = load_file(str(source / "model.safetensors")), load_file(str(tmp_path / "out/model.safetensors"))
    assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "out/config.json").read_text())["text_config"]["tie_word_embeddings"] is False


def test_our_adapter_loads_in_hf_peft_on_the_multimodal_model(tmp_path):
    hf = build_mistral3_multimodal()
    hf.save_pretrained(tmp_path / "mm")
    ours = AutoLigerForCausalLM.from_pretrained(tmp_path / "mm", dtype=torch.float32)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets="all-linear", init=False))
    save_adapter(ours, tmp_path / "adapter")
    clean = copy.deepcopy(hf)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    adapted = [n for n, m in loaded.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 2 * 7 and not [n for n in adapted if "vision_tower" in n or "multi_modal_projector" in n]
    exact = peft.PeftModel.from_pretrained(float64_reference(clean), tmp_path / "adapter").eval()
    ids = text_batch()
    with torch.no_grad():
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, loaded(input_ids=ids).logits,
                                       exact(input_ids=ids).logits, redraw=ulp_moved_logits(ours, ids))


# mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json (no top-level tie_word_embeddings: transformers 5 ties
# by default, and unties a checkpoint that stores its own head, as hub.py does).
MISTRAL_SMALL_31 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                    "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                    "sliding_window": None, "use_cache": True, "vocab_size": 131072},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_feature_layer": -1,
    "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
                      "image_size": 1540, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "pixtral",
                      "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14,
                      "rope_theta": 10000.0},
}


def test_mistral_small_31_config_loads_with_transformers_logits(tmp_path):
    """The file with the decoder shrunk (2 layers, hidden 64, 4 kv groups of 8 heads of 128 → 8 heads, a 512-token
    vocabulary) and a one-layer vision tower; its RoPE base (1e9), head_dim and norms kept."""
    import transformers

    raw = copy.deepcopy(MISTRAL_SMALL_31)
    raw["text_config"].update(num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=512,
                              num_attention_heads=8, num_key_value_heads=2)
    raw["vision_config"].update(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                head_dim=16, image_size=28)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    hf = transformers.Mistral3ForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = AutoLigerForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert (ours.config.rope_theta, ours.config.head_dim, ours.config.sliding_window) == (1e9, 128, None)
    ids = torch.randint(0, 512, (2, 13))
    with torch.no_grad():
        assert max_rel(ours(ids).logits, hf(input_ids=ids).logits) < 1e-5
