"""torch.compile(fullgraph=True) over Qwen3 (q/k norms: the unfused custom ops while tracing), Mixtral and
Qwen3-MoE (the routed experts as custom ops, the aux loss traced): a training step and logits equal eager's bit for
bit under "aot_eager" (test_compile.py's protocol)."""

from __future__ import annotations

import pytest
import torch

from liger_models import (LigerMixtralForCausalLM, LigerQwen3ForCausalLM, LigerQwen3MoeForCausalLM, MixtralConfig,
                          Qwen3Config, Qwen3MoeConfig)

MODELS = {"qwen3": (LigerQwen3ForCausalLM, Qwen3Config), "mixtral": (LigerMixtralForCausalLM, MixtralConfig),
          "qwen3_moe": (LigerQwen3MoeForCausalLM, Qwen3MoeConfig)}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("kernels", ["interpreted", "cpu reference"])
def test_compiled_training_step_equals_eager(family, kernels, monkeypatch):
    if kernels == "cpu reference":  # a CPU without Triton's interpreter: every custom op runs its PyTorch reference
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    cls, config_cls = MODELS[family]
    extra = {} if family == "qwen3" else {"output_router_logits": True}
    model = cls.from_config(config_cls.tiny(**extra))
    ids = torch.randint(3, 128, (2, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].repeat(2, 1)
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        loss = run(ids, labels=ids, position_ids=positions).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            logits = run(ids, position_ids=positions).logits
        results.append((loss.detach(), logits, grads))
    (loss, logits, grads), (c_loss, c_logits, c_grads) = results
    assert torch.equal(c_loss, loss) and torch.equal(c_logits, logits)
    for name in grads:
        assert torch.equal(c_grads[name], grads[name]), name
