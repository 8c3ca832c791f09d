"""Activation checkpointing recomputes each layer inside backward: through this project's Triton kernels (the
interpreter on CPU) the loss and every gradient must equal the run without it, and the kernels' refusal of
double backward (create_graph=True) must not fire on the recomputation."""

from __future__ import annotations

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.gemma import GemmaConfig
from liger_models.gemma2 import Gemma2Config
from liger_models.llama import LlamaConfig
from liger_models.train import distributed as D
from tests.helpers import CHUNKED_GRAD_REL, SavedBytes

from .parity import max_rel


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved_bytes_of_a_step(model, ids) -> int:
    """Bytes autograd keeps for backward in one training step (parameters left out), then the backward."""
    with SavedBytes(exclude=model.parameters()) as saved:
        loss = model(ids, labels=ids).loss
    loss.backward()
    return saved.total


@pytest.mark.parametrize("config_cls", [LlamaConfig, GemmaConfig], ids=["llama", "gemma"])
def test_recomputed_layers_give_the_same_gradients(config_cls):
    config = config_cls.tiny(num_hidden_layers=2)
    model = AutoLigerForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    model.train()
    loss0, grads0 = _loss_and_grads(model, ids)
    assert D.apply_activation_checkpointing(model.model.layers) == 2
    loss1, grads1 = _loss_and_grads(model, ids)
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        assert torch.equal(grads1[name], grad), name


@pytest.mark.parametrize("how", ["model", "wrapper"])
@pytest.mark.parametrize("config_cls", [LlamaConfig, GemmaConfig], ids=["llama", "gemma"])
def test_a_checkpointed_layer_keeps_one_stream_tensor(config_cls, how):
    """What a checkpoint keeps until backward is its inputs: each checkpointed layer must hold one (B, T, H) tensor of
    the residual stream, not the (x, residual) pair the layers pass between them (which doubled the checkpoints'
    memory: 3 GiB at Qwen2.5-7B, 4 × 4096 tokens). Two more layers keep exactly two more stream tensors."""
    B, T = 2, 24
    saved = {}
    for layers in (2, 4):
        config = config_cls.tiny(num_hidden_layers=layers)
        model = AutoLigerForCausalLM.from_config(config)
        if how == "model":
            model.activation_checkpointing_enable()
        else:
            D.apply_activation_checkpointing(model.model.layers)
        model.train()
        saved[layers] = _saved_bytes_of_a_step(model, torch.randint(0, config.vocab_size, (B, T)))
    assert saved[4] - saved[2] == 2 * B * T * config.hidden_size * 4, saved


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("config_cls", [LlamaConfig, Gemma2Config], ids=["llama", "gemma2-sandwich"])
def test_mlp_chunks_give_the_unchunked_loss_and_gradients(config_cls, checkpointing):
    """Chunks of 7 rows over 2 × 24 tokens (the last one short), each recomputed in backward: the loss and every
    gradient as without chunks (fp32, each row's numbers are the same ops on the same values; a weight's gradient
    sums its rows chunk by chunk)."""
    config = config_cls.tiny(num_hidden_layers=2)
    model = AutoLigerForCausalLM.from_config(config)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
    ids = torch.randint(0, config.vocab_size, (2, 24))
    loss, grads = _loss_and_grads(model, ids)
    recomputed = []
    for layer in model.model.layers:
        layer._mlp_rows = lambda rows, f=layer._mlp_rows: (recomputed.append(rows.shape[0]), f(rows))[1]
    model.mlp_chunking_enable(7)
    chunked_loss, chunked = _loss_and_grads(model, ids)
    # per layer and chunk: forward, then its own recompute in backward; a checkpointed layer's recompute runs the
    # chunks again, except what torch's non-reentrant checkpoint skips once it has every tensor it saved
    runs = {7: recomputed.count(7), 6: recomputed.count(6)}
    assert (runs[7] >= 2 * 6 * 2 and runs[6] >= 2 * 2) if checkpointing else runs == {7: 2 * 6 * 2, 6: 2 * 2}, runs
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():  # CHUNKED_GRAD_REL's note: the same up to the order of fp32 sums
        assert max_rel(chunked[name], grad) <= CHUNKED_GRAD_REL, (name, max_rel(chunked[name], grad))
    model.mlp_chunking_disable()
    assert all(layer.mlp_chunk_tokens is None for layer in model.model.layers)


def test_mlp_chunks_keep_no_gate_up_output_for_backward():
    """Without chunks every layer keeps its (B·T, 2I) gate|up output for backward; with them only the stream rows
    each chunk starts from, so at least that much less is kept."""
    config = LlamaConfig.tiny(num_hidden_layers=2)
    B, T = 2, 24
    kept = {}
    for chunked in (False, True):
        model = AutoLigerForCausalLM.from_config(config)
        model.train()
        if chunked:
            model.mlp_chunking_enable(8)
        kept[chunked] = _saved_bytes_of_a_step(model, torch.randint(0, config.vocab_size, (B, T)))
    gate_up = B * T * 2 * config.intermediate_size * 4
    assert kept[False] - kept[True] >= config.num_hidden_layers * gate_up, kept


def test_mlp_chunking_refuses_moe_layers_and_bad_sizes():
    from liger_models import MixtralConfig

    model = AutoLigerForCausalLM.from_config(MixtralConfig.tiny())
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model.mlp_chunking_enable(8)
    dense = AutoLigerForCausalLM.from_config(LlamaConfig.tiny())
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            dense.mlp_chunking_enable(bad)
