"""PEFT's modules_to_save (embed_tokens, lm_head trained whole beside the adapters, as a chat fine-tune with new
tokens does): trainable here, saved in the adapter file under PEFT's names, loaded by HF + PEFT with the same
logits and back here from an adapter HF + PEFT trained; tied embeddings and other names are refused."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch

from liger_models.lora import LoraSettings, add_lora, load_adapter, lora_state_dict, merged_state_dict, save_adapter

from .common import pair
from .test_peft_format import assert_same_logits

WHOLE = ["embed_tokens", "lm_head"]


def _settings(**kw):
    return LoraSettings(**{"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "init": False,
                           "modules_to_save": WHOLE, **kw})


def test_trainable_saved_under_peft_names_and_loaded_by_hf_peft(tmp_path):
    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=False)
    add_lora(ours, _settings())
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= trainable
    assert all(".lora_" in n or n in ("model.embed_tokens.weight", "lm_head.weight") for n in trainable)
    with torch.no_grad():  # as if trained: rows of the whole modules differ from the base's
        ours.model.embed_tokens.weight.add_(0.01 * torch.randn_like(ours.model.embed_tokens.weight))
        ours.lm_head.weight.add_(0.01 * torch.randn_like(ours.lm_head.weight))
    save_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == sorted(WHOLE)
    clean = copy.deepcopy(hf)
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(3, 128, (2, 11))
    assert_same_logits(ours, loaded, clean, ids, tmp_path)


def test_hf_peft_adapter_with_modules_to_save_loads_here(tmp_path):
    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=False)
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                                      modules_to_save=WHOLE, init_lora_weights=False))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.01 * torch.randn_like(p))
    trained.save_pretrained(tmp_path / "hf_adapter")
    load_adapter(ours, tmp_path / "hf_adapter", trainable=True)
    assert ours.lm_head.weight.requires_grad and ours.model.embed_tokens.weight.requires_grad
    ids = torch.randint(3, 128, (2, 11))
    assert_same_logits(ours, trained, clean, ids, tmp_path)
    # merged export carries the trained whole modules
    merged = merged_state_dict(ours)
    assert torch.equal(merged["lm_head.weight"], ours.lm_head.weight)
    assert set(lora_state_dict(ours)) >= {"model.embed_tokens.weight", "lm_head.weight"}


def test_tied_embeddings_and_other_names_are_refused(tmp_path):
    _, tied, _ = pair("llama", tmp_path, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="ties lm_head to embed_tokens"):
        add_lora(tied, _settings())
    with pytest.raises(ValueError, match=r"modules_to_save: 'q_proj' is not supported \(only embed_tokens, lm_head"):
        _settings(modules_to_save=["q_proj"])
