"""torch.compile over our models: every fused kernel is opaque to dynamo (a clean graph break around each one), so a
compiled model runs the same kernels and gives the same loss and gradients as the eager model.

Runs the real Triton kernels in the interpreter on CPU with the "eager" backend (dynamo's tracing and graph
breaks, no code generation: nothing to compile on a CPU-only CI machine).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from liger_models import AutoLigerForCausalLM

from .parity import build_hf, save_hf


@pytest.mark.parametrize("config_cls, extra", [
    (transformers.LlamaConfig, {}),
    (transformers.GemmaConfig, {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}),
    (transformers.Phi3Config, {"pad_token_id": 0}),
])
def test_compiled_model_equals_eager(config_cls, extra, tmp_path):
    torch._dynamo.reset()
    model = AutoLigerForCausalLM.from_pretrained(save_hf(build_hf(config_cls, **extra), tmp_path / "hf"),
                                                 dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 12))
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None].repeat(2, 1)  # two packed documents per row
    results = []
    for run in (model, torch.compile(model, backend="eager")):
        model.zero_grad(set_to_none=True)
        out = run(ids, labels=ids, position_ids=positions)
        out.loss.backward()
        with torch.no_grad():
            logits = run(ids, position_ids=positions).logits
        results.append((out.loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, logits, grads), (c_loss, c_logits, c_grads) = results
    assert torch.equal(c_loss, loss) and torch.equal(c_logits, logits)
    for name in grads:
        assert torch.equal(c_grads[name], grads[name]), name
