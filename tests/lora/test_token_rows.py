"""Trainable-token rows (PEFT's trainable_token_indices: new or untrained tokens' rows of the embedding table and of
lm_head) trained here: one step against float64 HF + PEFT with the same adapter, through the fused loss (the rows
as its low-rank term) and the logits; merged and unmerged; saved, reloaded and exported; refused where they cannot
be honoured."""

from __future__ import annotations

import copy

import peft
import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM
from liger_models.lora import (LoraSettings, add_lora, load_adapter, lora_modules, lora_state_dict, merge_lora,
                               save_adapter, save_merged, unmerge_lora)
from liger_models.modules.lora_embedding import LoraEmbedding
from liger_models.modules.lora_linear import LoraLinear

from ..models.parity import max_rel
from .common import assert_matches_float64_peft, pair, peft_float64

ROWS = "token_adapter.trainable_tokens_delta"


def inputs_with(tokens: list[int], vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): random tokens with each chosen token in the input and among the targets."""
    ids = torch.randint(3, vocab, (2, 11))
    for i, token in enumerate(tokens):
        ids[i % 2, 2 + 3 * (i // 2)] = token
        ids[(i + 1) % 2, 4 + 3 * (i // 2)] = token
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def chosen(rows) -> list[int]:
    return sorted({t for ids in (rows.values() if isinstance(rows, dict) else [rows]) for t in ids})


def with_rows(family: str, tmp_path, rows, tie: bool | None = None):
    """(hf, ours with q/v adapters and the rows moved off their start, a copy of hf PEFT has not touched)."""
    hf, ours, _ = pair(family, tmp_path, **({} if tie is None else {"tie_word_embeddings": tie}))
    targets = ["qkv_proj"] if family == "phi3" else ["q_proj", "v_proj"]
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=targets, init=False, trainable_token_indices=rows))
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(ROWS):
                p.add_(torch.randn_like(p))
    return hf, ours, copy.deepcopy(hf)


@pytest.mark.parametrize("family, tie, rows", [
    ("llama", False, [3, 5, 9]),
    ("llama", True, [3, 5, 9]),  # the tied lm_head reads the embedding's rows: one parameter, two uses
    ("llama", False, {"embed_tokens": [3], "lm_head": [3, 4]}),
    ("llama", False, {"lm_head": [7, 9]}),
    ("llama", False, [0, 5]),  # the padding token's row: no gradient, as F.embedding gives the padding row
    ("gemma", None, [4, 6]),  # tied, √H-scaled embedding: the rows go in before the scale
    ("gemma2", None, [4, 6]),  # tied, the final logit soft-cap applied to the logits with the rows' term
    ("phi3", False, [3, 5]),
    ("qwen3", False, {"embed_tokens": [6], "lm_head": [6, 8]}),
])
def test_token_rows_train_like_hf_peft(family, tie, rows, tmp_path):
    hf, ours, clean = with_rows(family, tmp_path, rows, tie)
    owners = [n for n, m in lora_modules(ours).items() if getattr(m, "token_adapter", None) is not None]
    assert len(owners) == (len(rows) if isinstance(rows, dict) else 1)
    truth = peft_float64(clean, ours, tmp_path / "float64")
    assert any("trainable_tokens_delta" in n for n, p in truth.named_parameters() if p.requires_grad)
    grads = assert_matches_float64_peft(ours, truth, inputs=inputs_with(chosen(rows)))
    row_grads = {n: g for n, g in grads.items() if n.endswith(ROWS)}
    assert sorted(row_grads) == sorted(f"{n}.{ROWS}" for n in owners)
    for name, grad in row_grads.items():
        ids = (rows if isinstance(rows, list) else rows[name.split(".")[-3]])
        for i, token in enumerate(ids):
            if token == 0 and name.startswith("model.embed_tokens") and not ours.config.tie_word_embeddings:
                assert torch.count_nonzero(grad[i]) == 0, "the padding row took a gradient"
            else:
                assert grad[i].abs().max() > 0, (name, token)
    # nothing else of the tables trains
    assert not ours.model.embed_tokens.weight.requires_grad and not ours.lm_head.weight.requires_grad


def test_tied_head_shares_the_embedding_rows(tmp_path):
    _, ours, _ = with_rows("llama", tmp_path, [3, 5], tie=True)
    assert isinstance(ours.lm_head, LoraLinear) and ours.lm_head.token_adapter is None
    assert ours.lm_head.token_rows is ours.model.embed_tokens.token_adapter
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert [n for n in lora_state_dict(ours) if "token" in n] == [f"model.embed_tokens.{ROWS}"]
    assert sum(n.endswith("trainable_tokens_delta") for n, _ in ours.named_parameters()) == 1


@pytest.mark.parametrize("tie, rows", [(False, {"embed_tokens": [3, 7], "lm_head": [5]}), (True, [3, 7])])
def test_merge_unmerge_and_the_merged_export(tie, rows, tmp_path):
    """merge copies the rows into the tables (the tied head then reads them there) with the same logits; unmerge
    puts the original rows back bit for bit (the q/v adapters up to their round trip's roundings); the merged export
    loads in transformers with the same logits."""
    _, ours, _ = with_rows("llama", tmp_path, rows, tie)
    ids = inputs_with(chosen(rows))[0]
    tables = {n: m.weight.detach().clone() for n, m in lora_modules(ours).items() if m.token_adapter is not None}
    ours.eval()
    with torch.no_grad():
        before = ours(ids).logits
        save_merged(ours, tmp_path / "merged")
        merge_lora(ours)
        merged = ours(ids).logits
    assert max_rel(merged, before) < 1e-5
    for name, m in lora_modules(ours).items():
        if m.token_adapter is not None:
            assert torch.equal(m.weight[m.token_adapter.token_indices], m.token_adapter.trainable_tokens_delta)
    unmerge_lora(ours)
    for name, table in tables.items():
        assert torch.equal(ours.get_submodule(name).weight, table), name
    with torch.no_grad():
        assert max_rel(ours(ids).logits, before) < 1e-5
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert max_rel(exported(input_ids=ids).logits, before) < 1e-5


def test_saved_rows_load_to_train_on(tmp_path):
    """load_adapter(trainable=True) gives the rows back as trained parameters, the same logits and the same step;
    without it they are frozen and decode the same."""
    _, ours, directory = pair("llama", tmp_path)
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=["q_proj"], init=False, trainable_token_indices=[3, 5]))
    with torch.no_grad():
        ours.model.embed_tokens.token_adapter.trainable_tokens_delta.add_(1.0)
    save_adapter(ours, tmp_path / "adapter")
    ids, labels = inputs_with([3, 5])
    loss = ours(ids, labels=labels).loss
    loss.backward()
    for trainable in (True, False):
        again = AutoLigerForCausalLM.from_pretrained(directory, dtype=torch.float32)
        load_adapter(again, tmp_path / "adapter", trainable=trainable)
        rows = again.model.embed_tokens.token_adapter.trainable_tokens_delta
        assert rows.requires_grad is trainable
        assert torch.equal(rows, ours.model.embed_tokens.token_adapter.trainable_tokens_delta)
        out = again(ids, labels=labels).loss
        assert torch.equal(out, loss.detach()) or max_rel(out.detach(), loss.detach()) < 1e-6
        if trainable:
            out.backward()
            assert torch.equal(rows.grad, ours.model.embed_tokens.token_adapter.trainable_tokens_delta.grad)


def test_a_tied_model_with_lm_head_rows_from_peft_is_refused(tmp_path):
    """PEFT gives a tied model's lm_head rows its embedding does not get (one matrix in the checkpoint, two here):
    such an adapter used to load with the rows written into the shared matrix, both tables changed and logits ~80
    off HF + PEFT's. No merged or tied checkpoint can hold it, so it is refused by name."""
    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=True)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                            trainable_token_indices={"lm_head": [3, 5]})).save_pretrained(
        tmp_path / "adapter")
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=r"names lm_head \[3, 5\], but this model ties it to embed_tokens"):
        load_adapter(ours, tmp_path / "adapter")
    assert not lora_modules(ours) and all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())


def test_token_rows_that_cannot_be_honoured_are_refused(tmp_path):
    _, ours, _ = pair("llama", tmp_path)
    with pytest.raises(ValueError, match=r"model.embed_tokens: both a LoRA target and in trainable_token_indices"):
        add_lora(ours, LoraSettings(targets=["q_proj", "embed_tokens"], trainable_token_indices=[3]))
    with pytest.raises(ValueError, match=r"'embed_tokens' is both in modules_to_save .* and in trainable_token"):
        LoraSettings(modules_to_save=["embed_tokens"], trainable_token_indices=[3])
    with pytest.raises(ValueError, match=r"must be distinct token ids"):
        LoraSettings(trainable_token_indices=[3, 3])
    with pytest.raises(ValueError, match=r"names token 128, but model.embed_tokens has 128 rows"):
        add_lora(ours, LoraSettings(targets=["q_proj"], trainable_token_indices=[128]))
    assert not lora_modules(ours) and type(ours.model.embed_tokens) is torch.nn.Embedding
    add_lora(ours, LoraSettings(targets=["q_proj"], trainable_token_indices=[3]))
    assert isinstance(ours.model.embed_tokens, LoraEmbedding)
    with pytest.raises(ValueError, match=r"save_pretrained: the model carries LoRA adapters"):
        ours.save_pretrained(tmp_path / "dense")


def test_rows_of_tokens_a_resize_added_train_like_hf_peft(tmp_path):
    """The chat fine-tune this is for: the vocabulary grown by four tokens (resize_token_embeddings), their rows in
    both untied tables trained beside q/v adapters, against float64 HF + PEFT on the same resized tables."""
    hf, ours, _ = pair("llama", tmp_path, tie_word_embeddings=False)
    ours.resize_token_embeddings(132)
    new = [128, 129, 130, 131]
    add_lora(ours, LoraSettings(r=4, alpha=8, targets=["q_proj", "v_proj"], init=False,
                                trainable_token_indices={"embed_tokens": new, "lm_head": new}))
    hf.resize_token_embeddings(132)
    with torch.no_grad():  # the same new rows on both sides
        hf.get_input_embeddings().weight.copy_(ours.model.embed_tokens.weight)
        hf.get_output_embeddings().weight.copy_(ours.lm_head.weight)
        for name, p in ours.named_parameters():
            if name.endswith(ROWS):
                p.add_(torch.randn_like(p))
    truth = peft_float64(copy.deepcopy(hf), ours, tmp_path / "float64")
    grads = assert_matches_float64_peft(ours, truth, inputs=inputs_with(new, vocab=132))
    for name in (f"model.embed_tokens.{ROWS}", f"lm_head.{ROWS}"):
        assert (grads[name].abs().amax(dim=1) > 0).all(), name
