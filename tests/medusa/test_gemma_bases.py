"""Medusa tree decoding on Gemma 2 and Gemma 3 bases: the verification call's tree mask goes through Gemma 2's
soft-capped attention (the math path) and Gemma 3's two RoPE tables; greedy Medusa output equals plain greedy."""

import pytest
import torch

from liger_models import Gemma2Config, Gemma3TextConfig, LigerGemma2ForCausalLM, LigerGemma3ForCausalLM
from liger_models.medusa import MedusaModel


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_medusa_greedy_equals_plain_greedy(family, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference path: this tests decoding, not kernels
    config_cls, model_cls = {"gemma2": (Gemma2Config, LigerGemma2ForCausalLM),
                             "gemma3": (Gemma3TextConfig, LigerGemma3ForCausalLM)}[family]
    base = model_cls.from_config(config_cls.tiny(initializer_range=0.3), dtype=torch.float64)
    medusa = MedusaModel.from_base(base, num_heads=2)
    ids = torch.randint(3, 128, (1, 7))
    plain = base.generate(ids, max_new_tokens=12, eos_token_id=[], do_sample=False)
    # Neither stops at the config's EOS: a random base emits it now and then, which would end one of them early.
    assert torch.equal(medusa.generate(ids, max_new_tokens=12, eos_token_id=[]), plain)
