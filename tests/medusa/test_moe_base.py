"""Medusa on a mixture-of-experts base: stage 2 keeps the base's load-balancing term where its config sets
output_router_logits (the loss is what the base's own forward gives plus the heads' terms, and the router gets the
term's gradient); without that setting, and in stage 1, there is none, as the base's own forward has none."""

from __future__ import annotations

import pytest
import torch

from liger_models import LigerMixtralForCausalLM, LigerQwen3MoeForCausalLM, MixtralConfig, Qwen3MoeConfig
from liger_models.medusa import MedusaModel

FAMILIES = {"mixtral": (LigerMixtralForCausalLM, MixtralConfig), "qwen3_moe": (LigerQwen3MoeForCausalLM, Qwen3MoeConfig)}


def _pair(family, **overrides):
    cls, config_cls = FAMILIES[family]
    base = cls.from_config(config_cls.tiny(**overrides))
    return base, MedusaModel.from_base(base, stage=2, num_heads=2)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stage2_adds_the_load_balancing_term_as_the_base_does(family):
    base, medusa = _pair(family, output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(3, base.config.vocab_size, (2, 12))
    out = medusa(ids, labels=ids)
    own = base(ids, labels=ids)  # the base's own forward: CE + coef · aux
    torch.testing.assert_close(out.aux_loss, own.aux_loss.detach(), rtol=0, atol=0)
    base.config.output_router_logits = False
    plain = medusa(ids, labels=ids)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * own.aux_loss, rtol=1e-6, atol=1e-6)
    # The router gets the term's gradient: the difference of the two losses' router gradients is coef · d aux.
    routers = [p for n, p in base.named_parameters() if n.endswith(("mlp.gate.weight", "router.weight"))]
    assert routers
    grads = [torch.autograd.grad(loss, routers, retain_graph=True) for loss in (out.loss, plain.loss)]
    aux_grads = torch.autograd.grad(0.5 * own.aux_loss, routers)
    for with_term, without, expected in zip(*grads, aux_grads):
        torch.testing.assert_close(with_term - without, expected, rtol=1e-4, atol=1e-7)


def test_stage1_has_no_load_balancing_term():
    base, _ = _pair("mixtral", output_router_logits=True)
    medusa = MedusaModel.from_base(base, stage=1, num_heads=2)
    ids = torch.randint(3, base.config.vocab_size, (2, 12))
    assert medusa(ids, labels=ids).aux_loss is None
