"""Stage 1 trains the heads only (base bit-identical after optimizer steps); stage 2 trains both, heads at lr × 4."""

import pytest
import torch

from liger_models.medusa import MedusaModel
from tests.helpers import assert_matches
from tests.medusa._common import make_base, packed_batch

V, H = 37, 16


def _train(model, steps=3, lr=1e-2):
    opt = torch.optim.AdamW(model.param_groups(lr), lr=lr)
    for step in range(steps):
        ids, labels, pos = packed_batch(2, 10, V, packed=True)
        out = model(ids, labels=labels, position_ids=pos, step=step, max_steps=steps)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


@pytest.mark.parametrize("share", [False, True])
def test_stage1_leaves_base_bit_identical(share):
    base = make_base(V, H)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = MedusaModel.from_base(base, stage=1, num_heads=3, share_lm_head=share)
    heads_before = {k: v.clone() for k, v in model.heads.state_dict().items()}
    _train(model)
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), f"stage 1 changed base weight {k}"
    assert all(not p.requires_grad and p.grad is None for p in base.parameters())
    changed = [k for k, v in model.heads.state_dict().items() if not torch.equal(v, heads_before[k])]
    assert sorted(changed) == sorted(heads_before), "every head tensor (weights, biases, lm_heads) trains"


def test_stage1_base_runs_without_autograd_graph():
    model = MedusaModel.from_base(make_base(V, H), stage=1, num_heads=2)
    seen = []
    model.base.model.register_forward_hook(lambda m, i, o: seen.append((o.requires_grad, torch.is_grad_enabled())))
    ids, labels, _ = packed_batch(1, 6, V, packed=False)
    model(ids, labels=labels).loss.backward()
    assert seen == [(False, False)]


def test_param_groups_heads_at_4x_with_biases_and_base_in_stage2():
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2, num_layers=2)
    groups = model.param_groups(1e-3)
    heads, base = groups
    assert heads["lr"] == pytest.approx(4e-3) and base["lr"] == pytest.approx(1e-3)
    head_ids = {id(p) for p in heads["params"]}
    assert head_ids == {id(p) for p in model.heads.parameters()}
    assert all(id(b.linear.bias) in head_ids for k in range(2) for b in model.heads.resblocks(k))
    assert {id(p) for p in base["params"]} == {id(p) for p in model.base.parameters()}
    assert len(MedusaModel.from_base(make_base(V, H), stage=1, num_heads=2).param_groups(1e-3)) == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_param_groups_weight_decay_on_matrices_only(stage):
    """Weight decay shrinks what it touches towards 0: never the heads' ResBlock biases nor the base's RMSNorm weights
    (docs/medusa.md#loss-and-stages). The 1-D tensors keep their group's lr (heads × 4) in a no-decay sibling."""
    model = MedusaModel.from_base(make_base(V, H), stage=stage, num_heads=2, num_layers=2)
    groups = model.param_groups(1e-3, weight_decay=0.1)
    for g in groups:
        assert g["weight_decay"] == 0 or all(p.dim() >= 2 for p in g["params"]), g["name"]
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    assert len(lr_of) == sum(len(g["params"]) for g in groups)  # each parameter in one group
    assert {i for i in lr_of if lr_of[i] == pytest.approx(4e-3)} == {id(p) for p in model.heads.parameters()}
    trained = [*model.heads.parameters(), *(model.base.parameters() if stage == 2 else ())]
    assert set(lr_of) == {id(p) for p in trained}
    assert decayed == {id(p) for p in trained if p.dim() >= 2}


def test_stage2_trains_base_and_shared_head_is_not_pushed_by_heads():
    base = make_base(V, H)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = MedusaModel.from_base(base, stage=2, num_heads=2, share_lm_head=True)
    _train(model, steps=2)
    assert all(not torch.equal(v, before[k]) for k, v in base.state_dict().items())
    # With the base CE off, only the heads' terms remain: the shared lm_head must then get no gradient.
    model = MedusaModel.from_base(make_base(V, H), stage=2, num_heads=2, share_lm_head=True, base_loss_weight=0.0)
    ids, labels, pos = packed_batch(2, 8, V, packed=False)
    model(ids, labels=labels).loss.backward()
    assert model.base.lm_head.weight.grad is None
    assert model.base.model.layers[0].mlp.down_proj.weight.grad is not None


@pytest.mark.parametrize("stage", [1, 2])
def test_one_sgd_step_moves_heads_at_4x_lr_and_decays_matrices_only(stage):
    """What the groups do in an optimizer step, not just how they are labelled: plain SGD (update = lr·(g + wd·p))
    moves every head tensor, biases included, at 4·lr, the base (stage 2) at lr, and decays only ≥2-D tensors."""
    lr, wd = 0.05, 0.3
    model = MedusaModel.from_base(make_base(V, H), stage=stage, num_heads=2, num_layers=2)
    ids, labels, pos = packed_batch(2, 10, V, packed=True)
    model(ids, labels=labels, position_ids=pos).loss.backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.param_groups(lr, weight_decay=wd), lr=lr).step()
    assert {n.split(".")[0] for n in before} == ({"heads", "base"} if stage == 2 else {"heads"})
    for n, p in model.named_parameters():
        if n not in before:
            continue
        p0, g = before[n]
        step_lr = 4 * lr if n.startswith("heads.") else lr
        expected = p0.double() - step_lr * (g.double() + (wd * p0.double() if p.dim() >= 2 else 0))
        assert_matches(p.detach(), expected, name=n)
