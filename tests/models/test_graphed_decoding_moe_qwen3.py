"""CUDA-graph decoding (modules/graphed_decoding.py) for Qwen3 (q/k norms), Mixtral and Qwen3-MoE (routed experts):
the graphed steps give the eager path's tokens. On the CPU the graphed calls run eagerly (CAPTURE off, as in
test_graphed_decoding.py); capture and replay run in the GPU test (the experts' padded path then sizes its batch by
the token count instead of reading the largest group on the host)."""

import pytest
import torch

from liger_models import (LigerMixtralForCausalLM, LigerQwen3ForCausalLM, LigerQwen3MoeForCausalLM, MixtralConfig,
                          Qwen3Config, Qwen3MoeConfig)
from liger_models.modules import graphed_decoding
from tests.models.test_inference import left_padded

MODELS = {"qwen3-window": (LigerQwen3ForCausalLM, Qwen3Config, dict(use_sliding_window=True, sliding_window=4,
                                                                     max_window_layers=1)),
          "mixtral": (LigerMixtralForCausalLM, MixtralConfig, {}),
          "qwen3_moe": (LigerQwen3MoeForCausalLM, Qwen3MoeConfig, dict(mlp_only_layers=[0]))}


def _model(name: str, dtype=torch.float64, device="cpu"):
    cls, config_cls, extra = MODELS[name]
    return cls.from_config(config_cls.tiny(initializer_range=0.3, **extra), dtype=dtype, device=device)


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_graphed_equals_eager(monkeypatch, name):
    monkeypatch.setattr(graphed_decoding, "CAPTURE", False)
    model = _model(name)
    ids, mask = left_padded(2, 7, [0, 3])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=[])
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=9, eos_token_id=[], cuda_graph=True),
                       plain)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_cuda_graph_equals_eager_on_gpu(name, dtype):
    model = _model(name, dtype, "cuda")
    ids, mask = left_padded(2, 9, [0, 4])
    ids, mask = ids.cuda(), mask.cuda()
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[], cuda_graph=True)
    assert torch.equal(graphed, plain)
