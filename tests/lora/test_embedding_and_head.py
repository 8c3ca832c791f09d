"""LoRA on embed_tokens and lm_head (PEFT's Embedding and Linear adapters on them) against HF + PEFT in float64:
logits, loss and every adapter's gradient, with Gemma's √H embedding scale (a model-level multiply in Gemma, inside
the embedding module in Gemma 3, where PEFT scales the delta too); adapters both ways in PEFT's format; merge and the
merged export."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from liger_models.lora import LoraSettings, add_lora, load_adapter, lora_modules, merge_lora, save_merged, unmerge_lora
from liger_models.modules.lora_embedding import LoraEmbedding

from ..models.parity import float64_reference, max_rel
from .common import (assert_as_close_as_fp32_allows, assert_matches_float64_peft, batch, pair, peft_float64,
                     ulp_moved_logits)

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "embed_tokens", "lm_head"]


def _adapted(family, tmp_path, **lora_kw):
    hf, ours, _ = pair(family, tmp_path, tie_word_embeddings=False)
    add_lora(ours, LoraSettings(**{"r": 4, "alpha": 8, "targets": TARGETS, "init": False, **lora_kw}))
    return hf, ours


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma3", "qwen2"])
def test_embedding_and_head_adapters_match_float64_hf_peft(family, tmp_path):
    hf, ours = _adapted(family, tmp_path)
    assert isinstance(ours.model.embed_tokens, LoraEmbedding)
    assert {"model.embed_tokens", "lm_head"} <= set(lora_modules(ours))
    grads = assert_matches_float64_peft(ours, peft_float64(hf, ours, tmp_path))
    assert {"model.embed_tokens.lora_embedding_A", "model.embed_tokens.lora_embedding_B", "lm_head.lora_A.weight",
            "lm_head.lora_B.weight"} <= set(grads)
    assert ours.model.embed_tokens.weight.grad is None and ours.lm_head.weight.grad is None


def test_padding_row_of_the_embedding_adapter_gets_no_gradient(tmp_path):
    hf, ours = _adapted("llama", tmp_path, targets=["embed_tokens"])
    pad = ours.model.embed_tokens.padding_idx
    assert pad is not None
    ids, labels = batch()
    ids[0, 1] = pad
    ours(ids, labels=labels).loss.backward()
    grad = ours.model.embed_tokens.lora_embedding_A.grad
    assert torch.count_nonzero(grad[:, pad]) == 0 and torch.count_nonzero(grad) > 0


def test_hf_peft_adapter_on_embedding_and_head_loads_here(tmp_path):
    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=False)
    clean = copy.deepcopy(hf)
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS,
                                                      init_lora_weights=False))
    trained.save_pretrained(tmp_path / "hf_adapter")
    load_adapter(ours, tmp_path / "hf_adapter")
    assert torch.count_nonzero(ours.model.embed_tokens.lora_embedding_A) > 0
    ids, _ = batch()
    with torch.no_grad():
        exact = peft_float64(clean, ours, tmp_path / "float64").eval()(input_ids=ids.clone()).logits
        assert_as_close_as_fp32_allows(ours.eval()(ids).logits, trained.eval()(input_ids=ids).logits, exact,
                                       redraw=ulp_moved_logits(ours, ids))


def test_merge_unmerge_and_merged_export(tmp_path):
    hf, ours = _adapted("gemma", tmp_path)
    ids, _ = batch()
    ours.eval()
    with torch.no_grad():
        exact = peft_float64(hf, ours, tmp_path / "float64").eval()(input_ids=ids).logits
        bound = max(2 * max_rel(ours(ids).logits.double(), exact), 1e-5)
        table = ours.model.embed_tokens.weight.clone()
        merge_lora(ours)
        merged_table = ours.model.embed_tokens.weight.clone()
        assert not torch.equal(merged_table, table)
        assert max_rel(ours(ids).logits.double(), exact) <= bound
        unmerge_lora(ours)
        assert max_rel(ours(ids).logits.double(), exact) <= bound
        # E + Δ rounds to fp32 once and back: exact to an ulp of the merged table's entries (Δ dwarfs E here).
        ulp = torch.finfo(torch.float32).eps * merged_table.abs().max()
        assert (ours.model.embed_tokens.weight - table).abs().max() <= ulp
    save_merged(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():  # the export's weights, computing in float64 (parity.float64_reference)
        assert max_rel(float64_reference(merged)(input_ids=ids).logits, exact) <= bound


def test_parameter_counts_see_the_adapted_table_as_the_embedding(tmp_path):
    _, plain, _ = pair("llama", tmp_path / "plain", tie_word_embeddings=False)
    _, ours = _adapted("llama", tmp_path)
    adapter = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    table = ours.model.embed_tokens.weight.numel()
    assert ours.num_parameters() == plain.num_parameters() + adapter
    assert ours.num_parameters(exclude_embeddings=True) == plain.num_parameters(exclude_embeddings=True) + adapter
    assert ours.num_parameters(only_trainable=True) == adapter
    assert plain.num_parameters() - plain.num_parameters(exclude_embeddings=True) == table
