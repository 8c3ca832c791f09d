"""Medusa heads: key format, initialisation, no layer sharing, each head's module call vs a per-layer reference."""

import pytest
import torch

from liger_models.medusa import MedusaConfig, MedusaHeads
from tests.helpers import assert_matches
from tests.medusa._common import make_base, reference_heads_z


def _heads(share: bool, L: int, K: int = 3, base=None):
    base = base or make_base()
    cfg = MedusaConfig.for_base(base, num_heads=K, num_layers=L, share_lm_head=share)
    return base, MedusaHeads(cfg, base.lm_head)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("L", [1, 2])
def test_state_dict_keys_are_medusa_format(share, L):
    base, heads = _heads(share, L, K=3)
    expected = {f"{h}.{l}.linear.{p}" for h in range(3) for l in range(L) for p in ("weight", "bias")}
    if not share:
        expected |= {f"{h}.{L}.weight" for h in range(3)}
    assert set(heads.state_dict()) == expected
    # The shared lm_head is not a parameter of the heads (the base owns it).
    assert all(p is not base.lm_head.weight for p in heads.parameters())
    assert sum(p.numel() for p in heads.parameters()) == 3 * (L * (16 * 16 + 16) + (0 if share else 37 * 16))


def test_init_zero_weight_default_bias_copied_lm_head_and_no_sharing():
    base, heads = _heads(False, 2, K=2)
    params = list(heads.parameters())
    assert len({id(p) for p in params}) == len(params)  # every layer and head owns its tensors
    for k in range(2):
        for block in heads.resblocks(k):
            assert torch.count_nonzero(block.linear.weight) == 0
            bound = 1 / 16**0.5
            assert block.linear.bias.abs().max() <= bound and torch.count_nonzero(block.linear.bias) > 0
        w = heads.weight(k)
        assert torch.equal(w, base.lm_head.weight) and w.data_ptr() != base.lm_head.weight.data_ptr()
    biases = [b.linear.bias for k in range(2) for b in heads.resblocks(k)]
    assert not any(torch.equal(biases[0], b) for b in biases[1:])


def test_shared_weight_is_base_lm_head_detached():
    base, heads = _heads(True, 1)
    w = heads.weight(0)
    assert w.data_ptr() == base.lm_head.weight.data_ptr() and not w.requires_grad


@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("K", [1, 4])
def test_forward_matches_per_layer_reference(L, K):
    base, heads = _heads(False, L, K=K)
    for p in heads.parameters():  # non-zero weights so the check has teeth
        p.data.normal_()
    hidden = torch.randn(2, 5, 16)
    out = heads(hidden)
    sd64 = {k: v.double() for k, v in heads.state_dict().items()}
    ref = reference_heads_z(hidden.double(), sd64, K, L)
    assert len(out) == K
    for z, r in zip(out, ref):
        assert_matches(z, r, name="z")
    logits = heads.logits(hidden)
    assert logits.shape == (K, 2, 5, 37)
    assert_matches(logits[K - 1], ref[K - 1] @ sd64[f"{K - 1}.{L}.weight"].t(), name="logits")


def test_bad_inputs_raise():
    base = make_base()
    with pytest.raises(ValueError, match="hidden_size"):
        MedusaHeads(MedusaConfig(num_heads=2), base.lm_head)
    with pytest.raises(ValueError, match="lm_head"):
        MedusaHeads(MedusaConfig(num_heads=2, share_lm_head=True, hidden_size=16, vocab_size=37))
    with pytest.raises(ValueError, match="config expects"):
        MedusaHeads(MedusaConfig(num_heads=2, hidden_size=16, vocab_size=40), base.lm_head)
    with pytest.raises(ValueError, match="scheduler"):
        MedusaConfig(scheduler="cosine")
    _, heads = _heads(False, 1)
    for call in (heads, heads.logits, lambda h: heads.run(0, h, torch.nn.functional.linear)):
        with pytest.raises(ValueError, match="expect 16"):
            call(torch.randn(2, 3, 8))


def test_shared_lm_head_logits_use_the_base_projection():
    base, heads = _heads(True, 1, K=2)
    for p in heads.parameters():
        p.data.normal_()
    hidden = torch.randn(3, 16)
    logits = heads.logits(hidden)
    for k, z in enumerate(heads(hidden)):
        assert_matches(logits[k], z.double() @ base.lm_head.weight.double().t(), name="shared logits")


@pytest.mark.parametrize("share", [False, True])
def test_logits_of_the_first_heads(share):
    # Decoding asks only for the heads its tree reaches; those equal the full call's, shared head or own copies.
    _, heads = _heads(share, 1, K=4)
    for p in heads.parameters():
        p.data.normal_()
    hidden = torch.randn(2, 16)
    first = heads.logits(hidden, 2)
    assert first.shape == (2, 2, 37)
    assert_matches(first, heads.logits(hidden)[:2], name="first heads' logits")
    with pytest.raises(ValueError, match="expect 16"):
        heads.logits(torch.randn(2, 8), 2)
