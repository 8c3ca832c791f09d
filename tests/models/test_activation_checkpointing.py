"""Activation checkpointing recomputes each layer inside backward: through this project's Triton kernels (the
interpreter on CPU) the loss and every gradient must equal the run without it, and the kernels' refusal of
double backward (create_graph=True) must not fire on the recomputation."""

from __future__ import annotations

import pytest
import torch

from liger_models import AutoLigerForCausalLM
from liger_models.gemma import GemmaConfig
from liger_models.llama import LlamaConfig
from liger_models.train import distributed as D
from tests.helpers import SavedBytes


@pytest.mark.parametrize("config_cls", [LlamaConfig, GemmaConfig], ids=["llama", "gemma"])
def test_recomputed_layers_give_the_same_gradients(config_cls):
    config = config_cls.tiny(num_hidden_layers=2)
    model = AutoLigerForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    results = []
    for checkpointed in (False, True):
        if checkpointed:
            assert D.apply_activation_checkpointing(model.model.layers) == 2
        model.train()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
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
        ids = torch.randint(0, config.vocab_size, (B, T))
        with SavedBytes(exclude=model.parameters()) as kept:
            loss = model(ids, labels=ids).loss
        loss.backward()
        saved[layers] = kept.total
    assert saved[4] - saved[2] == 2 * B * T * config.hidden_size * 4, saved
