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
